"""SLURM: who we are in the job, and putting the job back in the queue after a preemption.

The batch script must ``exec python ...`` and ask for the signal with ``#SBATCH --signal=B:USR1@120``
(or be sent ``scancel --batch --signal=USR1 JOBID``): without ``exec`` the signal kills bash and
never reaches Python. ``#SBATCH --requeue`` lets ``scontrol requeue`` put the job back, and
``--open-mode=append`` keeps the first attempt's output. See ``examples/slurm/``.

The job's end (``end_time``) is read from SLURM itself, ``scontrol show job`` with
``SLURM_TIME_FORMAT=%s`` (epoch seconds, whatever the time zone), never computed from what the
job was asked for: a preemption with a grace time or ``scontrol update TimeLimit=`` moves it. So
rank 0 reads it when ``train()`` begins and, while the job's end is watched
(``trainfsm.preemption.deadline``), again every ``REREAD_SECONDS`` on a thread of its own
(``JobEnd``): a limit changed during the run is seen within a minute, earlier or later.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

_JOB_ID = re.compile(r"\d+")
_ARRAY_ID = re.compile(r"\d+_\d+")
_END_TIME = re.compile(r"(?:^|\s)EndTime=(\S+)")
_TIME_LIMIT = re.compile(r"(?:^|\s)TimeLimit=(\S+)")

#: How often rank 0 reads the job's end again while it watches it (``JobEnd``). Each read is one
#: ``scontrol`` process (about 10 ms of the node's time, on a thread of its own, never on the step's
#: path) and one request to ``slurmctld``, which every job of the cluster shares: once a minute is
#: one request per job a minute, however fast its steps. A limit changed to less than a minute (plus
#: the way out) from now may be seen too late; an end moved later is seen within a minute.
REREAD_SECONDS: Final = 60.0


@dataclass(frozen=True, slots=True)
class SlurmJob:
    job_id: str
    array_job_id: str | None
    array_task_id: str | None
    restart_count: int
    node: str | None
    procid: str | None
    #: The job's end (epoch seconds) as SLURM had it when ``train()`` began; read by rank 0 only
    #: (one ``scontrol`` call per job, not per rank). None on other ranks, without a time limit,
    #: or when SLURM could not say.
    end_time: float | None = None

    @property
    def requeue_id(self) -> str:
        """The id ``scontrol requeue`` needs: ``ARRAYJOBID_TASKID`` for an array task."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def as_event(self) -> dict[str, Any]:
        return asdict(self)


def detect(environ: Mapping[str, str] | None = None) -> SlurmJob | None:
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        restarts = 0
    return SlurmJob(
        job_id=job_id,
        array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
        array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
        restart_count=restarts,
        node=env.get("SLURMD_NODENAME"),
        procid=env.get("SLURM_PROCID"),
    )


def valid_job_id(job_id: str) -> bool:
    """Digits, or ``digits_digits`` for an array task: nothing else may reach a command line."""
    return bool(_JOB_ID.fullmatch(job_id) or _ARRAY_ID.fullmatch(job_id))


@dataclass(frozen=True, slots=True)
class RequeueResult:
    command: list[str]
    ok: bool
    message: str


def is_batch_job(job_id: str, timeout: float = 10.0) -> bool:
    """Whether ``job_id`` runs a batch script (``BatchFlag=1``), for ``requeue="auto"``."""
    scontrol = shutil.which("scontrol")
    if scontrol is None or not valid_job_id(job_id):
        return False
    try:
        shown = subprocess.run(
            [scontrol, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "BatchFlag=1" in shown.stdout


def requeue(job: SlurmJob, timeout: float = 30.0) -> RequeueResult:
    """``scontrol requeue`` the job; never raises: the result says what happened."""
    job_id = job.requeue_id
    command = ["scontrol", "requeue", job_id]
    if not valid_job_id(job_id):
        return RequeueResult(["scontrol", "requeue", "<invalid>"], False, f"refusing malformed SLURM job id {job_id!r}")
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return RequeueResult(
            command,
            False,
            "scontrol is not on PATH (inside a container?); the job was not requeued. Requeue it by hand or "
            "make scontrol available to the job.",
        )
    try:
        # A session of its own: once the job is requeued, SLURM's SIGTERM reaches every process of this
        # task's group, and scontrol, still exiting, would die of it and report a requeue that worked as failed.
        done = subprocess.run(
            [scontrol, "requeue", job_id], capture_output=True, text=True, timeout=timeout, start_new_session=True
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RequeueResult(command, False, f"{type(exc).__name__}: {exc}")
    message = (done.stdout + done.stderr).strip()
    return RequeueResult(command, done.returncode == 0, message or f"exit status {done.returncode}")


def end_time(job_id: str, timeout: float = 5.0) -> float | None:
    """The job's end, epoch seconds, from ``scontrol show job`` (None: no limit, or SLURM did not say
    within ``timeout``). About 10 ms on an idle controller; never raises."""
    shown = _show_job(job_id, timeout)
    return None if shown is None else parse_end_time(shown)


def _show_job(job_id: str, timeout: float) -> str | None:
    """``scontrol show job -o`` with epoch times; None where it could not say (no scontrol, an error,
    no answer within ``timeout``)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None or not valid_job_id(job_id):
        return None
    try:
        # Its own session, as for the requeue: a signal SLURM sends the job's processes (scancel
        # --signal, the requeue's SIGTERM) must not end the read half-way.
        shown = subprocess.run(
            [scontrol, "show", "job", "-o", job_id],
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


@dataclass(slots=True)
class EndTimeRead:
    """``end_time`` read in a thread of its own, so that a slow controller never delays the step or
    the save it overlaps: started at a preemption, collected (``result``) just before the requeue,
    which moves the job's end."""

    job_id: str
    end_time: float | None = None
    read_at: float | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> EndTimeRead:
        self._thread = threading.Thread(target=self._read, name="trainfsm-slurm-end-time", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        self.end_time = end_time(self.job_id)
        self.read_at = time.time()

    def result(self, timeout: float = 5.0) -> tuple[float | None, float | None]:
        """(the end, when it was read); (None, None) if the read has not finished within ``timeout``."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return None, None
        return self.end_time, self.read_at


class JobEnd:
    """The job's end as SLURM has it now (``end_time``, epoch seconds; None: no limit any more), for
    the deadline: the value read when ``train()`` began, then read again every ``every`` seconds
    (``REREAD_SECONDS``) on a thread of its own from ``start`` to ``stop``, so that no step waits
    for ``scontrol`` and a slow controller delays nothing but the next read. A read that fails keeps
    the last end: a busy controller must not disarm the deadline."""

    def __init__(self, job_id: str, end_time: float | None, every: float | None = None) -> None:
        self.job_id = job_id
        self.end_time = end_time
        self.every = REREAD_SECONDS if every is None else every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> JobEnd:
        self._thread = threading.Thread(target=self._follow, name="trainfsm-slurm-job-end", daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.every):
            shown = _show_job(self.job_id, timeout=5.0)
            if shown is not None and not self._stop.is_set():
                self.end_time = parse_end_time(shown)

    def stop(self) -> None:
        """No more reads. A read in flight is waited for a second at most: its answer is not needed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
