"""Asking SLURM: ``scontrol show job``, ``show partition`` and ``show config``, read and parsed.

Why one place: every read is a process and a request to ``slurmctld``, which every job of the
cluster shares, and each must behave the same way. A job id reaches a command line only once
validated (``valid_job_id``); ``scontrol`` runs in a session of its own, so that a signal SLURM
sends the job's processes (``scancel --signal``, a requeue's SIGTERM) does not end the read half-way;
times are asked for in epoch seconds (``SLURM_TIME_FORMAT=%s``, whatever the time zone); and a
read never raises: where SLURM could not say (no ``scontrol``, an error, no answer in time) the
answer is None and the caller keeps what it knew. Who reads when, and what for, is
``trainfsm.preemption.slurm``'s business.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Final

_JOB_ID = re.compile(r"\d+")
_ARRAY_ID = re.compile(r"\d+_\d+")
_PARTITION = re.compile(r"[\w.-]+")
_END_TIME = re.compile(r"(?:^|\s)EndTime=(\S+)")
_TIME_LIMIT = re.compile(r"(?:^|\s)TimeLimit=(\S+)")
_FIELD = re.compile(r"(?:^|\s)(JobState|Restarts|PreemptTime|Partition|GraceTime|PreemptMode|BatchFlag)=(\S+)")
_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)", re.MULTILINE)

#: Preemption modes after which the job does not run on: the checkpoint must be written.
LEAVING_MODES: Final = frozenset({"REQUEUE", "CANCEL"})


def valid_job_id(job_id: str) -> bool:
    """Digits, or ``digits_digits`` for an array task: nothing else may reach a command line."""
    return bool(_JOB_ID.fullmatch(job_id) or _ARRAY_ID.fullmatch(job_id))


def is_batch_job(job_id: str, timeout: float = 10.0) -> bool | None:
    """Whether ``job_id`` runs a batch script (``BatchFlag=1``), for ``requeue="auto"``; None when
    the controller did not answer within ``timeout``: then the requeue is tried, and its own
    answer recorded, rather than skipped without a word. An answer that is an error (no such job,
    no SLURM configured here) is False: not a batch job this trainer should requeue."""
    scontrol = shutil.which("scontrol")
    if scontrol is None or not valid_job_id(job_id):
        return False
    try:
        shown = subprocess.run(
            [scontrol, "show", "job", "-o", job_id],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return None  # a controller that does not answer: maybe a batch job
    except OSError:
        return False
    return shown.returncode == 0 and "BatchFlag=1" in shown.stdout  # an error: no such job, no SLURM here


@dataclass(frozen=True, slots=True)
class JobView:
    """What ``scontrol show job`` said of the job, and when it was read (epoch seconds)."""

    read_at: float
    end_time: float | None  # None: no limit, or not known (a pending job)
    state: str | None  # JobState: RUNNING, COMPLETING, PENDING, ...
    restarts: int | None  # Restarts: how often SLURM requeued the job so far
    preempt_time: float | None  # PreemptTime: when SLURM chose it for preemption; None: it has not
    partition: str | None
    batch: bool | None = None  # BatchFlag: it runs a batch script (``requeue="auto"`` requeues those)


def parse_job(shown: str, read_at: float) -> JobView:
    """``scontrol show job -o`` output (with ``SLURM_TIME_FORMAT=%s``) as a ``JobView``."""
    fields = dict(_FIELD.findall(shown))
    restarts = fields.get("Restarts", "")
    return JobView(
        read_at=read_at,
        end_time=parse_end_time(shown),
        state=fields.get("JobState"),
        restarts=int(restarts) if restarts.isdigit() else None,
        preempt_time=_epoch(fields.get("PreemptTime")),
        partition=fields.get("Partition"),
        batch={"1": True, "0": False}.get(fields.get("BatchFlag", "")),
    )


def _epoch(value: str | None) -> float | None:
    if value is None or value in ("None", "Unknown", "N/A"):
        return None
    if value.isdigit():
        return float(value)
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def show_job(job_id: str, timeout: float = 5.0) -> JobView | None:
    """The job as SLURM has it now; None where it could not say within ``timeout``. Never raises."""
    shown = show_job_output(job_id, timeout)
    return None if shown is None else parse_job(shown, time.time())


@dataclass(frozen=True, slots=True)
class Partition:
    """A partition's preemption settings, from ``scontrol show partition``."""

    name: str
    preempt_mode: str | None  # OFF, REQUEUE, CANCEL, SUSPEND, GANG,SUSPEND, ...
    grace_time: float | None  # seconds

    @property
    def preempts_with_grace(self) -> bool:
        """A job here may be preempted, end (requeued or cancelled), and have a grace time first."""
        return ends_job(self.preempt_mode) and bool(self.grace_time)


def parse_partition(name: str, shown: str) -> Partition:
    fields = dict(_FIELD.findall(shown))
    grace = fields.get("GraceTime", "")
    return Partition(name, fields.get("PreemptMode"), float(grace) if grace.isdigit() else None)


def show_partition(name: str, timeout: float = 5.0) -> Partition | None:
    """The partition's ``PreemptMode`` and ``GraceTime``; None where SLURM could not say."""
    if not _PARTITION.fullmatch(name):
        return None
    shown = _scontrol(["show", "partition", "-o", name], timeout)
    return None if shown is None else parse_partition(name, shown)


def kill_wait(timeout: float = 5.0) -> float | None:
    """The cluster's ``KillWait``: seconds from SLURM's SIGTERM to its SIGKILL (None: not known)."""
    shown = _scontrol(["show", "config"], timeout)
    found = _KILL_WAIT.search(shown) if shown is not None else None
    return float(found.group(1)) if found else None


def ends_job(preempt_mode: str | None) -> bool:
    """A ``PreemptMode`` (``REQUEUE``, ``GANG,SUSPEND``, ...) whose preemption ends the job."""
    return bool(set((preempt_mode or "").split(",")) & LEAVING_MODES)


def show_job_output(job_id: str, timeout: float) -> str | None:
    """``scontrol show job -o`` with epoch times; None where it could not say."""
    return _scontrol(["show", "job", "-o", job_id], timeout) if valid_job_id(job_id) else None


def _scontrol(args: list[str], timeout: float) -> str | None:
    """``scontrol ARGS``'s output, times in epoch seconds (``SLURM_TIME_FORMAT=%s``, whatever the
    time zone); None where SLURM could not say (no scontrol, an error, no answer within ``timeout``).
    Never raises."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        # Its own session, as for the requeue: a signal SLURM sends the job's processes (scancel
        # --signal, the requeue's SIGTERM) must not end the read half-way.
        shown = subprocess.run(
            [scontrol, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
            env={**os.environ, "SLURM_TIME_FORMAT": "%s"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shown.stdout if shown.returncode == 0 else None


def parse_end_time(shown: str) -> float | None:
    """``EndTime`` of ``scontrol show job -o`` output, in epoch seconds; None for an unlimited job
    (``TimeLimit=UNLIMITED``) or an end SLURM does not know (``Unknown``)."""
    limit = _TIME_LIMIT.search(shown)
    if limit is not None and limit.group(1) in ("UNLIMITED", "INFINITE"):
        return None
    found = _END_TIME.search(shown)
    if found is None:
        return None
    value = found.group(1)
    if value.isdigit():  # SLURM_TIME_FORMAT=%s
        return float(value)
    try:  # a SLURM that ignored SLURM_TIME_FORMAT: its default, in local time
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
