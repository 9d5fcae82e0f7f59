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

A preemption by a higher-priority job shows there too. SLURM (``PreemptType=preempt/partition_prio``
or ``preempt/qos``) sets the job's ``PreemptTime`` and moves its ``EndTime`` to the preemption plus
the partition's ``GraceTime`` at once (a job without a time limit keeps ``EndTime=Unknown``:
``grace_end``), but signals only the job's steps then: an ``exec python``
batch job hears nothing until the grace time is over (SIGTERM, then SIGKILL after ``KillWait``),
unless the admin set ``preempt_send_user_signal`` (``PreemptParameters=send_user_signal`` from
23.02), which sends the job's ``--signal`` at once. So for a job in a partition that preempts with
a grace time, rank 0 reads the job more often (``reread_seconds``: a third of the grace time, at
least ``PREEMPTED_REREAD_FLOOR``), and ``JobEnd`` hands a ``PreemptTime`` to the trainer as soon
as it sees one: the run leaves within the grace time, not within ``KillWait``.

After a signal, rank 0 reads the job once more (``JobRead``, overlapping the save): which
deadline applied (``deadline_after``: the grace time's end, the time limit, or ``KillWait`` after
a kill that has begun) and whether SLURM already requeued the job itself (``requeued_by_slurm``:
under ``PreemptMode=REQUEUE`` it does, and the trainer's own ``scontrol requeue`` then fails with
"Job is pending execution").

How SLURM is asked (``scontrol``, validated ids, a session of its own, never raising):
``trainfsm.preemption.scontrol``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

from trainfsm.preemption.scontrol import (
    LEAVING_MODES,
    JobView,
    Partition,
    ends_job,
    is_batch_job,
    kill_wait,
    parse_end_time,
    parse_job,
    parse_partition,
    show_job,
    show_job_output,
    show_partition,
    valid_job_id,
)

# The reads moved to ``trainfsm.preemption.scontrol``; their names stay importable from here.
__all__ = [
    "LEAVING_MODES",
    "PREEMPTED_REREAD_FLOOR",
    "REREAD_SECONDS",
    "JobEnd",
    "JobRead",
    "JobView",
    "KillDeadline",
    "Partition",
    "RequeueResult",
    "SlurmJob",
    "deadline_after",
    "detect",
    "grace_end",
    "is_batch_job",
    "kill_wait",
    "leaves_when_preempted",
    "parse_end_time",
    "parse_job",
    "parse_partition",
    "preempts_with_grace",
    "requeue",
    "requeued_by_slurm",
    "reread_seconds",
    "show_job",
    "show_partition",
    "valid_job_id",
    "with_job_details",
]


#: How often rank 0 reads the job's end again while it watches it (``JobEnd``). Each read is one
#: ``scontrol`` process (about 10 ms of the node's time, on a thread of its own, never on the step's
#: path) and one request to ``slurmctld``, which every job of the cluster shares: once a minute is
#: one request per job a minute, however fast its steps. A limit changed to less than a minute (plus
#: the way out) from now may be seen too late; an end moved later is seen within a minute.
REREAD_SECONDS: Final = 60.0
#: In a partition that preempts with a grace time, rank 0 reads the job every third of the grace
#: time, and never more often than this (``reread_seconds``). Each read is one
#: ``REQUEST_JOB_INFO_SINGLE``: 121 us of slurmctld's time on average, measured with ``sdiag`` on
#: the project's cluster (SLURM 22.05, 500 reads). At 10 s, 1,000 such jobs cost the controller
#: 12 ms a second (1.2 % of one thread), 10,000 jobs 12 %: the floor keeps a large cluster's
#: controller for its scheduler. A grace time of 30 s is then noticed within 10 s, which leaves
#: two thirds of it for the step in flight and the save.
PREEMPTED_REREAD_FLOOR: Final = 10.0


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
    #: The partition the job runs in, its ``PreemptMode`` (``OFF``: never preempted; ``REQUEUE``,
    #: ``CANCEL``, ...) and ``GraceTime`` (seconds): read by rank 0 when ``train()`` began.
    partition: str | None = None
    preempt_mode: str | None = None
    grace_time: float | None = None
    #: ``PreemptTime`` when ``train()`` began: SLURM chose this job for preemption already.
    preempt_time: float | None = None

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


@dataclass(frozen=True, slots=True)
class RequeueResult:
    command: list[str]
    ok: bool
    message: str


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


def with_job_details(job: SlurmJob, timeout: float = 5.0) -> SlurmJob:
    """``job`` with what rank 0 reads when ``train()`` begins: the job's end, its partition and the
    partition's preemption settings (two ``scontrol`` calls, about 7 ms)."""
    view = show_job(job.job_id, timeout)
    if view is None:
        return job
    partition = show_partition(view.partition, timeout) if view.partition else None
    return replace(
        job,
        end_time=view.end_time,
        partition=view.partition,
        preempt_mode=partition.preempt_mode if partition else None,
        grace_time=partition.grace_time if partition else None,
        preempt_time=view.preempt_time,
    )


def preempts_with_grace(job: SlurmJob) -> bool:
    """The job's partition, as read when ``train()`` began, may preempt it, end it and give it a
    grace time first: a ``PreemptTime`` is worth following, whatever the grace time's length."""
    return job.partition is not None and ends_job(job.preempt_mode) and bool(job.grace_time)


def reread_seconds(job: SlurmJob) -> float:
    """How often rank 0 reads the job while it trains: ``REREAD_SECONDS``, or in a partition that
    preempts with a grace time a third of it, at least ``PREEMPTED_REREAD_FLOOR``."""
    if job.grace_time is None or not preempts_with_grace(job):
        return REREAD_SECONDS
    return min(REREAD_SECONDS, max(PREEMPTED_REREAD_FLOOR, job.grace_time / 3))


def leaves_when_preempted(job: SlurmJob) -> bool:
    """Whether a preemption ends the job (``REQUEUE``, ``CANCEL``), so that the trainer must save:
    not in a ``SUSPEND`` (or ``GANG``) partition, whose preempted jobs are stopped and go on later.
    True when the mode is not known."""
    return job.preempt_mode is None or ends_job(job.preempt_mode)


def requeued_by_slurm(view: JobView | None, job: SlurmJob) -> bool:
    """SLURM has requeued the job since this attempt began (``Restarts`` grew): a preemption under
    ``PreemptMode=REQUEUE``, or someone's ``scontrol requeue``. Nothing is left for the trainer to
    requeue, and the job will run again."""
    return view is not None and view.restarts is not None and view.restarts > job.restart_count


@dataclass(frozen=True, slots=True)
class KillDeadline:
    """When SLURM's SIGKILL may come, and why then (``applied``):

    - ``"kill_wait"``: SLURM's kill had begun at the signal (a requeue or cancel by SLURM, the time
      limit reached): the signal + ``KillWait``;
    - ``"grace_time"``: preempted and still in its grace time: the grace time's end + ``KillWait``;
    - ``"time_limit"``: a signal before the time limit (``--signal``, ``scancel --signal``): the
      time limit + ``KillWait``.
    """

    applied: str
    kill_start: float  # when SLURM's SIGTERM comes (came)
    kill_wait: float | None
    kill_at: float  # kill_start + kill_wait; kill_start itself when KillWait is not known


def grace_end(view: JobView, job: SlurmJob) -> float | None:
    """When the grace time of a job SLURM chose for preemption ends (None: not chosen, or not
    known): its ``EndTime``, which SLURM moves there; for a job without a time limit, whose
    ``EndTime`` stays ``Unknown`` (measured on SLURM 22.05), ``PreemptTime`` + the partition's
    ``GraceTime`` as read when ``train()`` began."""
    if view.preempt_time is None:
        return None
    if view.end_time is not None:
        return view.end_time
    return view.preempt_time + job.grace_time if job.grace_time is not None else None


#: A time limit this close after the signal (seconds) means the signal was the limit's SIGTERM.
_AT_LIMIT: Final = 1.0


def deadline_after(
    view: JobView | None, job: SlurmJob, signal_at: float, wait: float | None, sigterm: bool = True
) -> KillDeadline | None:
    """The deadline that applied to a run that left at ``signal_at``, from the job as read just
    after; None when nothing says (no read, no limit). ``sigterm``: the run left on a SIGTERM,
    the signal SLURM kills with (not on another signal, its deadline, or a preemption it saw)."""
    if view is None:
        return None
    grace = grace_end(view, job)
    if view.state != "RUNNING" or requeued_by_slurm(view, job):
        applied, start = "kill_wait", signal_at
    elif grace is not None:
        applied, start = "grace_time", grace
    elif view.end_time is None:
        return None
    elif sigterm and view.end_time <= signal_at + _AT_LIMIT:
        applied, start = "kill_wait", signal_at
    else:
        applied, start = "time_limit", view.end_time
    return KillDeadline(applied, start, wait, start + (wait or 0.0))


class JobRead:
    """The job and ``KillWait`` read once in a thread of its own, so that a slow controller never
    delays the step or the save it overlaps: started at a preemption, collected (``result``) just
    before the requeue, which gives the job a new end."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.view: JobView | None = None
        self.kill_wait: float | None = None
        self._thread = threading.Thread(target=self._read, name="trainfsm-slurm-job-read", daemon=True)

    def start(self) -> JobRead:
        self._thread.start()
        return self

    def _read(self) -> None:
        self.view = show_job(self.job_id)
        self.kill_wait = kill_wait()

    def result(self, timeout: float = 5.0) -> tuple[JobView | None, float | None]:
        """(the job, ``KillWait``); (None, None) if the reads have not finished within ``timeout``."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None, None
        return self.view, self.kill_wait


class JobEnd:
    """The job as SLURM has it now, for the deadline and for a preemption's notice: ``end_time``
    (epoch seconds; None: no limit any more), read when ``train()`` began, then again every
    ``every`` seconds (``reread_seconds``) on a thread of its own from ``start`` to ``stop``, so
    that no step waits for ``scontrol`` and a slow controller delays nothing but the next read. A
    read that fails keeps the last end: a busy controller must not disarm the deadline; and where
    the start's read failed (no partition known), the first read that works learns the partition
    and with it how often to read.

    A read that shows a ``PreemptTime``, in a partition whose preemption ends the job
    (``leaves_when_preempted``), is handed to ``on_preempted`` (from this thread), again every
    quarter of a second until it takes it (True: the exit policy is known; before the end of BUILD
    it is not), then never again: ``preempted`` keeps it. The reads go on meanwhile."""

    def __init__(
        self,
        job: SlurmJob,
        every: float | None = None,
        on_preempted: Callable[[JobView], bool] | None = None,
    ) -> None:
        self.job = job
        self.end_time = job.end_time
        self._fixed = every  # a caller's interval (tests); else it follows the partition
        self.every = reread_seconds(job) if every is None else every
        self.on_preempted = on_preempted
        self.preempted: JobView | None = None
        self._pending: JobView | None = None
        if job.preempt_time is not None and leaves_when_preempted(job):  # chosen before train() began
            self._pending = JobView(time.time(), job.end_time, "RUNNING", job.restart_count, job.preempt_time, None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> JobEnd:
        self._thread = threading.Thread(target=self._follow, name="trainfsm-slurm-job-end", daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        next_read = time.monotonic() + self.every
        while True:
            offering = self._pending is not None and self.on_preempted is not None
            wait = self._HAND_OVER if offering else max(0.0, next_read - time.monotonic())
            if self._stop.wait(wait):
                return
            if time.monotonic() >= next_read:
                self._read()
                next_read = time.monotonic() + self.every
            pending = self._pending
            if pending is not None and self.on_preempted is not None and self.on_preempted(pending):
                self.preempted, self._pending = pending, None

    def _read(self) -> None:
        shown = show_job_output(self.job.job_id, timeout=5.0)
        if shown is None or self._stop.is_set():
            return
        view = parse_job(shown, time.time())
        self.end_time = view.end_time
        if self.job.partition is None and view.partition:  # the start's read failed: learn it now
            self._learn_partition(view.partition)
        first = self.preempted is None and self._pending is None
        if view.preempt_time is not None and first and leaves_when_preempted(self.job):
            self._pending = view

    def _learn_partition(self, name: str) -> None:
        partition = show_partition(name)
        self.job = replace(
            self.job,
            partition=name,
            preempt_mode=partition.preempt_mode if partition else None,
            grace_time=partition.grace_time if partition else None,
        )
        if self._fixed is None:
            self.every = reread_seconds(self.job)

    #: Seconds between two offers of a preemption the trainer could not take yet.
    _HAND_OVER: Final = 0.25

    def stop(self) -> None:
        """No more reads. A read in flight is waited for a second at most: its answer is not needed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
