"""The job's end as a transition: under SLURM with a time limit, the run leaves by the preemption
path by itself, before the limit, once the time left no longer covers the way out.

At its time limit SLURM signals the job (SIGTERM, SIGKILL after ``KillWait``) and marks it
``TIMEOUT``, whatever the job was doing. A job with ``--time`` and no ``--signal`` then loses the
steps since its last checkpoint, a save longer than ``KillWait`` is lost, and an attempt whose
remaining work runs a little past the limit ends ``TIMEOUT`` although training completed. Rank 0
knows the job's end (``SlurmJob.end_time``, read from SLURM when ``train()`` began), and the stall
watchdog's thread measures the run's own steps and saves; at each of its looks (4 a second: no
clock read on the step's path) it asks ``Deadline.due``. ``scontrol update TimeLimit=`` during the
run moves the end: rank 0 reads it again every minute on a thread of its own
(``slurm.JobEnd``, ``slurm.REREAD_SECONDS``), and the deadline follows, earlier or later. When::

    time left < steps x step + save + write + exit + margin

it raises the pending "signal" as if the exit policy's first signal had arrived
(``Preemption.deadline_reached``; the watcher's ``DEADLINE`` bit says that none did). The machine
then takes the preemption's path: at the end of the step every rank agrees (with several ranks the
step-end all-reduce carries it one step later, hence ``steps`` = 2), the checkpoint hook saves,
rank 0 requeues the job, and the process exits with the preemption code (``128 + signal``). The
trail says why: a ``deadline`` event with these figures, and ``signal_agreed`` with
``reason="deadline"``.

The figures:

- ``step``: the slowest of the last 100 steps the watchdog saw (a step that ends in an evaluation
  or an interval's save counts with it);
- ``save``: the slowest save the watchdog saw in this attempt; before the first one, the state's
  bytes at ``UNMEASURED_SAVE_BYTES_PER_SECOND`` (the slowest rate the watchdog plans for);
- ``write``: with ``async_save``, what the save still writes once CHECKPOINT has staged it, and
  EXIT waits for before the requeue: the slowest write of the attempt as the background writer
  timed it (``checkpoint.background.WriteTimes``; CHECKPOINT alone is the staging, milliseconds),
  plus the rest of a write in flight, which the preemption's CHECKPOINT waits for first; 0 for
  synchronous saves;
- ``exit``: ``EXIT_SECONDS``, for EXIT's hooks, the batch drawn for the data ledger after the
  save (``data_cursor.EXIT_DRAW_SECONDS`` at most), ``scontrol requeue``, the trail's close and
  the interpreter's end;
- ``margin``: ``job_end_margin`` seconds, or with ``"auto"`` the larger of ``AUTO_MARGIN_FLOOR``
  and ``AUTO_MARGIN_SHARE`` of the rest: steps vary, a save may meet a slow file system, and the
  watchdog looks a quarter of a second late at most.

Nothing is armed outside SLURM, without a time limit, with ``job_end_margin=None``, or on ranks
other than 0 (the agreement reaches them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from trainfsm.preemption.slurm import JobEnd

#: Seconds allowed from the checkpoint being durable to the process's end.
EXIT_SECONDS: Final = 5.0
#: ``job_end_margin="auto"``: at least this many seconds...
AUTO_MARGIN_FLOOR: Final = 10.0
#: ...or this share of the way out (steps, save and exit), if larger.
AUTO_MARGIN_SHARE: Final = 0.25
#: A save's time before the attempt measured one: the state's bytes at this rate.
UNMEASURED_SAVE_BYTES_PER_SECOND: Final = 20e6


@dataclass(frozen=True, slots=True)
class Deadline:
    """When the way out no longer fits before the job's end as SLURM has it now (``job_end``)."""

    job_end: JobEnd  # its end_time (epoch seconds) read again while the run trains
    margin: float | None  # seconds; None: auto
    steps: int  # steps that may still run before the ranks agree: 1, or 2 with several ranks

    @classmethod
    def for_job(cls, job_end: JobEnd | None, margin: float | str | None, world: int) -> Deadline | None:
        """The deadline of this rank's job; None where nothing is armed (see the module's docstring)."""
        if job_end is None or margin is None:
            return None
        return cls(job_end, None if margin == "auto" else float(margin), 2 if world > 1 else 1)

    def due(
        self, now: float, step: float, save: float, save_measured: bool = True, write: float = 0.0
    ) -> dict[str, Any] | None:
        """The figures for the trail's ``deadline`` event when it is time to leave, else None
        (``save_measured``: False when ``save`` is the estimate from the state's bytes; ``write``:
        what an asynchronous save still writes after CHECKPOINT, which EXIT waits for)."""
        end_time = self.job_end.end_time
        if end_time is None:  # the limit was lifted (TimeLimit=UNLIMITED)
            return None
        way_out = self.steps * step + save + write + EXIT_SECONDS
        margin = self.margin if self.margin is not None else max(AUTO_MARGIN_FLOOR, AUTO_MARGIN_SHARE * way_out)
        left = end_time - now
        if left >= way_out + margin:
            return None
        return {
            "end_time": end_time,
            "decided_at": round(now, 3),
            "left": round(left, 3),
            "needed": round(way_out + margin, 3),
            "steps": self.steps,
            "step_seconds": round(step, 3),
            "save_seconds": round(save, 3),
            "save_measured": save_measured,
            "write_seconds": round(write, 3),
            "exit_seconds": EXIT_SECONDS,
            "margin": round(margin, 3),
        }
