"""SLURM: who we are in the job, and putting the job back in the queue after a preemption.

The batch script must ``exec python ...`` and ask for the signal with ``#SBATCH --signal=B:USR1@120``
(or be sent ``scancel --batch --signal=USR1 JOBID``): without ``exec`` the signal kills bash and
never reaches Python. ``#SBATCH --requeue`` lets ``scontrol requeue`` put the job back, and
``--open-mode=append`` keeps the first attempt's output. See ``examples/slurm/``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

_JOB_ID = re.compile(r"\d+")
_ARRAY_ID = re.compile(r"\d+_\d+")


@dataclass(frozen=True, slots=True)
class SlurmJob:
    job_id: str
    array_job_id: str | None
    array_task_id: str | None
    restart_count: int
    node: str | None
    procid: str | None

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
