"""Leaving a SLURM job: the job as read after the signal, and putting it back in the queue.

Why apart from the signals: this is what rank 0 (or a stalled rank, from the watchdog's thread)
does once the run is on its way out, and it talks to SLURM, where the rest of
``trainfsm.preemption.policy`` never waits on anything. In order:

1. ``record_job_end``: the job as SLURM had it just after the signal (``slurm.JobRead``, started at
   the preemption, overlapping the save) and the deadline that applied
   (``slurm.deadline_after``), in the trail's ``job_end``, for the audit's margin. Before the
   requeue, which gives the job a new end.
2. ``Requeue.run``: ``scontrol requeue`` by the exit policy's rules (``requeue``: ``True``,
   ``False`` or ``"auto"``, batch jobs only; ``max_requeues`` against ``SLURM_RESTART_COUNT``),
   unless SLURM requeued the job itself (``PreemptMode=REQUEUE``: ``Restarts`` grew), when the
   trainer's own requeue fails with "Job is pending execution" and nothing has failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainfsm.preemption import slurm


def record_job_end(
    log: Any, read: slurm.JobRead, job: slurm.SlurmJob | None, left_at: float | None, cause: str, sigterm: bool
) -> slurm.JobView | None:
    """The trail's ``job_end``: the job as read since the preemption began (``read``), and the
    deadline that applied to a run that left at ``left_at`` for ``cause`` (``sigterm``: on SLURM's
    own kill signal). Returns the job as read (None where SLURM did not say in time)."""
    view, wait = read.result()
    left_at = left_at if left_at is not None else time.time()
    kill = slurm.deadline_after(view, job, left_at, wait, sigterm) if job is not None else None
    log.info(
        "job_end",
        end_time=view.end_time if view else None,
        read_at=round(view.read_at, 3) if view else None,
        after=cause,
        applied=kill.applied if kill else None,
        kill_start=kill.kill_start if kill else None,
        kill_wait=wait,
        kill_at=kill.kill_at if kill else None,
        job_state=view.state if view else None,
        restarts=view.restarts if view else None,
    )
    return view


class Requeue:
    """The job's requeue, once: who put it back in the queue (``requeued_by``)."""

    def __init__(self) -> None:
        #: Who put the job back in the queue: "trainer" (``scontrol requeue``), "slurm" (it had
        #: already: ``PreemptMode=REQUEUE``), or None.
        self.requeued_by: str | None = None
        self.after_signal: slurm.JobView | None = None  # rank 0: the job as read after the signal

    def run(
        self,
        job: slurm.SlurmJob | None,
        requeue: bool | str,
        cap: int | None,
        record: Callable[..., None],
        refused: str | None = None,
    ) -> None:
        """Requeue ``job`` by these rules (``requeue``, ``cap``: ``max_requeues``); ``record(level,
        event=..., **fields)`` writes the ``requeue`` event. ``refused``: why a job these rules
        would requeue is not."""
        if job is None or requeue is False:
            return
        if requeue == "auto":
            view = self.after_signal  # read since the signal; else ask (None: SLURM did not say: try)
            batch = view.batch if view is not None and view.batch is not None else slurm.is_batch_job(job.job_id)
            if batch is False:
                return
        if cap is not None and job.restart_count >= cap:
            refused = f"SLURM_RESTART_COUNT={job.restart_count} reached max_requeues={cap}"
        if refused is not None:
            record(
                "error", event="requeue", command=None, ok=False, message=f"not requeued: {refused}", requeued_by=None
            )
            return
        if slurm.requeued_by_slurm(self.after_signal, job):  # PreemptMode=REQUEUE did it already
            self._by_slurm(record, None, self.after_signal)
            return
        result = slurm.requeue(job)
        if not result.ok:  # "Job is pending execution": SLURM may have requeued it meanwhile
            view = slurm.show_job(job.job_id, timeout=2.0)  # short: KillWait runs
            if slurm.requeued_by_slurm(view, job):
                self._by_slurm(record, result, view)
                return
        self.requeued_by = "trainer" if result.ok else None
        record(
            "info" if result.ok else "error",
            event="requeue",
            command=" ".join(result.command),
            ok=result.ok,
            message=result.message,
            requeued_by=self.requeued_by,
        )

    def _by_slurm(
        self, record: Callable[..., None], result: slurm.RequeueResult | None, view: slurm.JobView | None
    ) -> None:
        """SLURM requeued the job itself: the run will resume, and nothing failed."""
        self.requeued_by = "slurm"
        said = f"; scontrol requeue said: {result.message}" if result is not None else ""
        state = f"JobState={view.state} Restarts={view.restarts}" if view is not None else ""
        record(
            "info",
            event="requeue",
            command=" ".join(result.command) if result is not None else None,
            ok=True,
            message=f"SLURM requeued the job itself ({state}){said}",
            requeued_by="slurm",
        )
