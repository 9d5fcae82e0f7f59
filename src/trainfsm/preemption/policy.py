"""Preemption: everything about ending a run cleanly on a signal, in one module and one object.

``Preemption`` is created by ``train()`` before anything else and stopped at its end. It owns the
exit policy (from ``set_exit_signals()`` or the first hook that declares one through
``BaseHook.exit_policy``), the handlers (``SignalWatcher``), the cross-rank agreement on a pending
signal, the SLURM requeue (done by ``trainfsm.preemption.requeue``) and the exit wait. The trainer
asks it three questions, each at a safe point of the machine, and acts on the answer with a
transition:

- ``before_training()`` at the end of BUILD and of RESTORE: leave by ``preempt``?
- ``at_step_end(step)`` after every optimizer step: checkpoint (if a hook wants), then ``finish``?
- ``at_exit(preempted)`` entering EXIT: report what arrived, requeue the job (rank 0, SLURM).

The job's end is a fourth way in: under SLURM with a time limit the watchdog's thread calls
``deadline_reached`` when the time left no longer covers the way out
(``trainfsm.preemption.deadline``), and the run leaves as if the policy's first signal had come.
Rank 0 also reads the job from SLURM again at a preemption (``job_end``: which deadline applied,
``slurm.deadline_after``), for the audit's margin; and, while the deadline watches the job's end or
its partition preempts with a grace time, every minute or every third of the grace time
(``follow_job_end``): ``scontrol update TimeLimit=`` moves the end, and a preemption by another
job sets ``PreemptTime``, which takes the run out at once (``slurm_preempted``, the trail's
``preempted``): SLURM signals an ``exec python`` batch job only when the grace time is over.

A scheduler's signal (SLURM's ``--signal=B:USR1@120``, a ``SIGTERM`` before a kill) can arrive at
any instant: inside a kernel launch, a checkpoint write, a collective. The handler therefore only
records which signal came, when, and in which state; it does no I/O, takes no lock and starts no
collective: the handler records, the machine acts at the next safe point. The trainer looks at the
record at the end of every optimizer step and, once all ranks agree that a signal is pending, takes
``save`` to CHECKPOINT and ``finish`` to EXIT with reason ``preempted``; a signal during BUILD or
RESTORE takes ``preempt`` straight to EXIT.

Across ranks a signal that reached only one rank still stops every rank at the same step: one small
all-reduce per step carries it, started when the step begins and waited for when it ends
(``trainfsm.collectives.SignalAgreement``, a CPU flag in the gloo host group: no device sync);
at the end of BUILD and RESTORE one blocking one, or, with ``loss_none_agreement=True``, it
rides on the all-reduce that agrees on each micro-batch before its backward.

How the signals are held from the first line of ``train()`` until the policy is known, and
passed on when it does not name them: ``trainfsm.preemption.signals``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

from trainfsm import collectives
from trainfsm.collectives import SignalAgreement
from trainfsm.preemption import slurm
from trainfsm.preemption.requeue import Requeue, record_job_end
from trainfsm.preemption.signals import (
    DEADLINE,
    HELD_SIGNALS,
    PREEMPTED,
    REPORTED_SIGNALS,
    SIGNAL_BITS,
    Received,
    SignalWatcher,
    disposition,
    on_launcher_death,
    restore_launcher_death,
    state_at_start,
    stop_launcher_at_exit,
)
from trainfsm.preemption.torchelastic import under_torchrun

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from trainfsm.collectives import LossNoneAgreement
    from trainfsm.hooks.base import BaseHook

# The handlers' names stay importable from here, where they lived before ``trainfsm.preemption.signals``.
__all__ = [
    "DEFAULT_EXIT_SIGNALS",
    "HELD_SIGNALS",
    "REPORTED_SIGNALS",
    "ExitCode",
    "ExitPolicy",
    "Preemption",
    "Received",
    "SignalWatcher",
    "disposition",
    "exit_policy",
    "on_launcher_death",
    "restore_launcher_death",
    "state_at_start",
]

ExitCode = int | Literal["128+signal"]

#: ``CheckpointingHook``'s exit signals when none are given: safe by default.
DEFAULT_EXIT_SIGNALS: Final[tuple[signal.Signals, ...]] = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True, slots=True)
class ExitPolicy:
    """Which signals end training, with which exit code, after how long a wait, and whether to
    requeue the SLURM job (``True``, ``False`` or ``"auto"``: only inside a SLURM batch job)."""

    signals: tuple[signal.Signals, ...]
    code: ExitCode = "128+signal"
    wait: float = 0.0
    requeue: bool | Literal["auto"] = "auto"
    max_requeues: int | None = None

    def exit_code(self, signum: int) -> int:
        return 128 + signum if self.code == "128+signal" else int(self.code)


def exit_policy(
    owner: str,
    signals: Iterable[int | signal.Signals] | int | signal.Signals | None,
    code: Any = "128+signal",
    wait: Any = 0.0,
    requeue: Any = "auto",
    max_requeues: Any = None,
) -> ExitPolicy:
    """Validate exit-signal settings; errors name ``owner``'s argument and what is allowed."""
    items = [] if signals is None else [signals] if isinstance(signals, int) else list(signals)
    parsed = []
    for item in items:
        try:
            parsed.append(signal.Signals(item))
        except (ValueError, TypeError):
            raise ValueError(
                f"{owner} exit_signals must be signal.Signals (e.g. signal.SIGTERM, signal.SIGUSR1); got {item!r}."
            ) from None
    if code != "128+signal" and (isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255):
        raise ValueError(f"{owner} exit_code must be '128+signal' or an int in 0..255; got {code!r}.")
    seconds = wait.total_seconds() if isinstance(wait, timedelta) else wait
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"{owner} exit_wait must be seconds >= 0 or a timedelta; got {wait!r}.")
    if requeue not in (True, False, "auto"):
        raise ValueError(f"{owner} requeue must be True, False or 'auto'; got {requeue!r}.")
    if max_requeues is not None and (
        isinstance(max_requeues, bool) or not isinstance(max_requeues, int) or max_requeues < 0
    ):
        raise ValueError(f"{owner} max_requeues must be an int >= 0 or None; got {max_requeues!r}.")
    return ExitPolicy(tuple(dict.fromkeys(parsed)), code, float(seconds), requeue, max_requeues)


class Preemption:
    """Signals in, exit codes and a requeue out. Created by ``train()`` before anything else."""

    def __init__(self, policy: ExitPolicy | None, where: Any) -> None:
        #: ``set_exit_signals()``'s policy; else, after BUILD, the first hook's that names signals.
        self.policy = policy
        own = policy.signals if policy is not None else ()
        #: Which signals were ignored, blocked or pending as ``train()`` began (``run_start``).
        self.at_start = state_at_start((*REPORTED_SIGNALS, *own))
        self.watcher = SignalWatcher(where)  # ``where``: the trainer, whose step and state it records
        if policy is None:  # a hook may declare it: hold what schedulers send until BUILD knows
            self.watcher.install(HELD_SIGNALS)
        else:  # known from the start: only its signals are ours, the others keep their handlers
            self.watcher.install(own)
            self.watcher.acting = frozenset(own)
        self._launcher_death = on_launcher_death(signal.SIGTERM)  # torchrun died: workers must not train on
        self.log: Any = None  # the trail's logger, once the trail is open
        self.rank, self.world = 0, 1
        self.job: slurm.SlurmJob | None = None
        self._requeue = Requeue()  # the job as read after the signal, and who requeued it
        self._step_agreement: SignalAgreement | None = None
        # Where the signal pending on any rank at a step's end comes from, when not from this
        # rank alone (None): the step's signal all-reduce, or the last micro-batch agreement's.
        # Chosen in ``decide``; read once per step.
        self._agreed: Callable[[], int] | None = None
        # The job's end: the watchdog's figures when it raised the deadline (written by the trainer's
        # thread at the step's end), and rank 0's read of the end at a preemption.
        self._deadline: dict[str, Any] | None = None
        self._end_read: slurm.JobRead | None = None
        self._job_end: slurm.JobEnd | None = None  # rank 0, while it follows the job (see follow_job_end)
        self._cause = "signal"
        # Rank 0: SLURM chose the job for preemption (its PreemptTime, seen by ``JobEnd``'s thread),
        # and whether the trail has said so yet.
        self._preemption: slurm.JobView | None = None
        self._preemption_noticed_at = 0.0
        self._preemption_reported = False
        self._left_at: float | None = None  # when the first signal (or the notice) made the run leave
        self._left_by = 0  # and which signal (the policy's first for the deadline or a notice)

    def open_trail(self, log: Any, rank: int, world: int, job: slurm.SlurmJob | None) -> None:
        self.log, self.rank, self.world, self.job = log, rank, world, job

    def stop(self) -> None:
        """The end of ``train()``: the handlers and parent-death signal it found are back."""
        if self._job_end is not None:
            self._job_end.stop()
        restore_launcher_death(self._launcher_death)
        self.watcher.restore()

    def follow_job_end(self, for_deadline: bool = True) -> slurm.JobEnd | None:
        """The job as SLURM has it, read again every ``slurm.reread_seconds`` until ``stop``: on
        rank 0 (the one rank that read it at the start) under SLURM, with a time limit when the
        deadline watches it (``for_deadline``), or in a partition that preempts with a grace time
        (a ``PreemptTime`` takes the run out: ``slurm_preempted``); None elsewhere."""
        job = self.job
        if job is None or self.rank != 0:
            return None
        # A partition whose preemption ends the job is followed whatever its GraceTime (a grace time
        # of minutes is read every minute; under preempt/qos the QOS's grace applies, which the
        # partition does not show); so is a job whose partition the start's read could not learn
        # (leaves_when_preempted: True when not known). PreemptMode=OFF: only for the deadline.
        preemptible = slurm.leaves_when_preempted(job) or job.preempt_time is not None
        if not preemptible and not (for_deadline and job.end_time is not None):
            return None
        self._job_end = slurm.JobEnd(job, on_preempted=self.slurm_preempted).start()
        return self._job_end

    def _followed(self) -> slurm.SlurmJob | None:
        """The job as rank 0 knows it: with its partition learnt since the start, where the start's
        read could not say (``JobEnd``)."""
        return self._job_end.job if self._job_end is not None else self.job

    def slurm_preempted(self, view: slurm.JobView) -> bool:
        """From ``JobEnd``'s thread: SLURM chose the job for preemption (``view.preempt_time``).
        Pending from now on as the exit policy's first signal (the ``DEADLINE`` bit), unless a
        signal is already pending (SLURM's user signal may have come first): the same way out.
        False while the policy is not known (BUILD), so that it is offered again."""
        policy = self.policy
        if policy is None or not policy.signals:
            return False
        self._preemption_noticed_at = time.time()
        self._preemption = view  # before the bit: the trainer's thread reads it once it sees it
        self.watcher.raise_deadline(policy.signals[0], preempted=True)
        return True

    # ---------------------------------------------------------------- BUILD
    def decide(self, hooks: Sequence[BaseHook], agreement: LossNoneAgreement | None) -> ExitPolicy | None:
        """The hooks exist: settle the policy, act on the held signals it names, pass the others
        on, and choose how a pending signal reaches every rank. Returns the policy."""
        if self.policy is None:
            self.policy = next((h.exit_policy for h in hooks if h.exit_policy and h.exit_policy.signals), None)
        self._decide_held()
        if self.policy is not None:
            if not self.watcher.installed_any:
                self.log.warning("signals_not_installed", reason="train() is not running in the main thread")
            if self.world > 1 and agreement is None:
                self._step_agreement = SignalAgreement()
                self._agreed = self._step_agreement.result
        if agreement is not None:  # the signal rides on its all-reduce, with or without a policy
            self._agreed = lambda: agreement.signal
        return self.policy

    def _decide_held(self) -> None:
        """The policy is known (or BUILD failed before it was): act on the signals it names; a
        held signal it does not name gets its old disposition back and, if it came meanwhile, is
        raised again here, after the trail says so (it may end the process at once)."""
        if self.watcher.acting is not None:
            return
        policy = self.policy
        for arrival, how in self.watcher.decide(policy.signals if policy is not None else ()):
            name = signal.Signals(arrival.signum).name
            self.log.warning(
                "signal_passed_on", signal=name, received_at=arrival.at, at_state=arrival.state, disposition=how
            )
            signal.raise_signal(arrival.signum)

    # ---------------------------------------------------------------- the questions
    def before_training(self) -> int | None:
        """A signal during BUILD or RESTORE: the exit code to leave by ``preempt`` with, or None.

        With several ranks they agree first (one blocking all-reduce, at the end of BUILD and of
        RESTORE only), so a signal that reached one rank alone stops every rank here: a rank
        leaving alone would strand the others in their next collective, and only rank 0 requeues.
        """
        pending = self.watcher.pending
        if self.policy is not None:
            pending = collectives.max_over_ranks(pending)
        return self._preempted_by(pending) if pending else None

    def step_began(self) -> None:
        if self._step_agreement is not None:  # overlaps the step's work; waited for at its end
            self._step_agreement.start(self.watcher.pending)

    def at_step_end(self, step: int) -> int | None:
        """After the optimizer step: the exit code if a signal is pending on any rank, else None."""
        agreed = self._agreed
        local = self.watcher.pending
        ended = time.time() if local else None  # the clock only once a signal is pending here
        pending = agreed() if agreed is not None else local
        if not pending:
            return None
        code = self._preempted_by(pending)
        figures = self._deadline
        if pending & DEADLINE and figures is not None and self._preemption is None:  # the job's end coming
            self.log.warning("deadline", **figures)
        self.log.info(
            "signal_agreed",
            signal=signal.Signals(pending & SIGNAL_BITS).name,
            agreed_step=step,
            reason=self._cause,
            step_ended_at=ended,
        )
        return code

    def deadline_reached(self, figures: dict[str, Any]) -> bool:
        """From the watchdog's thread: the job's end is near. Pending from now on as the exit
        policy's first signal (with the ``DEADLINE`` bit); ``figures`` go to the trail's
        ``deadline`` event at the step's end. False without a policy, or with a signal pending."""
        policy = self.policy
        if policy is None or not policy.signals:
            return False
        self._deadline = figures  # before the bit: the trainer's thread reads them once it sees it
        if not self.watcher.raise_deadline(policy.signals[0]):
            self._deadline = None
            return False
        return True

    def end_step_agreement(self) -> None:
        """The step ends without its optimizer step (the data ran out): collect the step's
        all-reduce so no rank leaves one behind. The run is complete; the signal changes nothing."""
        if self._agreed is not None:
            self._agreed()

    def _preempted_by(self, pending: int) -> int:
        arrivals = self.watcher.received
        if self._left_at is None:
            self._left_at = arrivals[0].at if arrivals else time.time()
            self._left_by = pending & SIGNAL_BITS
        self.report()
        self._report_preemption()
        if self._preemption is not None or pending & PREEMPTED:  # PREEMPTED: rank 0's, through the agreement
            self._cause = "preemption"
        else:
            self._cause = "deadline" if pending & DEADLINE else "signal"
        job = self.job
        if job is not None and self.rank == 0 and self._end_read is None:
            self._end_read = slurm.JobRead(job.job_id).start()  # overlaps the save; see at_exit
        signum = pending & SIGNAL_BITS
        return self.policy.exit_code(signum) if self.policy is not None else 128 + signum

    def _report_preemption(self) -> None:
        """The trail's ``preempted``, once, from the trainer's thread: when SLURM chose the job,
        the grace time's end, and when rank 0 saw it."""
        view = self._preemption
        if view is None or self._preemption_reported:
            return
        self._preemption_reported = True
        job = self._followed()
        self.log.warning(
            "preempted",
            preempt_time=view.preempt_time,
            grace_end=slurm.grace_end(view, job) if job else view.end_time,
            grace_time=job.grace_time if job else None,
            mode=job.preempt_mode if job else None,
            read_at=round(view.read_at, 3),
            noticed_at=round(self._preemption_noticed_at, 3),
        )

    def report(self) -> None:
        """Record the arrivals not yet in the trail."""
        for arrival in self.watcher.take_new():
            self.log.warning(
                "signal_received",
                signal=signal.Signals(arrival.signum).name,
                received_at=arrival.at,
                at_step=arrival.step,
                at_state=arrival.state,
            )

    # ---------------------------------------------------------------- EXIT
    def at_exit(self, preempted: bool) -> None:
        """Entering EXIT's own work, after the hooks' (the checkpoint is durable by then)."""
        self._decide_held()  # BUILD failed before the policy was known: held signals are passed on
        self.report()
        if preempted:  # a PreemptTime seen in the EXIT of a completed run is not why it ended
            self._report_preemption()
        pending = self.watcher.pending
        # Another rank's signal, or this rank's own deadline or notice of a preemption: this node's
        # agent got no signal, and would restart its workers.
        if preempted and (not pending or pending & DEADLINE):
            agent = stop_launcher_at_exit(signal.SIGTERM)
            if agent is not None:
                self.log.warning("launcher_stop", pid=agent, signal="SIGTERM", at="process exit")
        if preempted and self.rank == 0:
            self._record_job_end()  # before the requeue, which gives the job a new end
            self._requeue_by_policy()
            if self._requeue.requeued_by == "trainer":
                self._await_requeue_signal()
            self.report()

    #: After ``scontrol requeue``, SLURM sends the job SIGTERM (4-14 ms later, measured): waited
    #: for this long at most, so that the trail records it before ``exit``.
    REQUEUE_SIGNAL_SECONDS: Final = 2.0

    def _await_requeue_signal(self) -> None:
        """The SIGTERM a requeue brings, when SIGTERM is one of ours (else it ends the process)."""
        if signal.SIGTERM in (self.watcher.acting or ()):
            self.watcher.wait_for_arrival(self.REQUEUE_SIGNAL_SECONDS)

    def _record_job_end(self) -> None:
        """The job as SLURM has it after the signal (read since the preemption began): its end,
        and the deadline that applied (``trainfsm.preemption.requeue.record_job_end``)."""
        read, self._end_read = self._end_read, None
        if read is None:
            return
        sigterm = self._cause == "signal" and self._left_by == signal.SIGTERM
        view = record_job_end(self.log, read, self._followed(), self._left_at, self._cause, sigterm)
        self._requeue.after_signal = view

    def stopped_for_restart(self) -> str | None:
        """A collective failed: if an exit signal had reached this rank under torchrun, the name of
        that signal. Its agent sends SIGTERM to healthy workers when it restarts the group after a
        peer died; the group cannot agree on a step any more, so this rank leaves without a
        checkpoint and the restarted group resumes from the last complete one."""
        pending = self.watcher.pending
        if not pending or not under_torchrun():
            return None
        return signal.Signals(pending & SIGNAL_BITS).name

    @property
    def requeued_by(self) -> str | None:
        """Who put the job back in the queue: "trainer" (``scontrol requeue``), "slurm" (it had
        already: ``PreemptMode=REQUEUE``), or None."""
        return self._requeue.requeued_by

    def _requeue_by_policy(self) -> None:
        policy = self.policy
        if policy is not None:
            self._requeue.run(self.job, policy.requeue, policy.max_requeues, self._record)

    def _record(self, level: str, **fields: Any) -> None:
        getattr(self.log, level)(**fields)

    def requeue_after_stall(self, record: Callable[..., None], refused: str | None = None) -> None:
        """The stall watchdog ends the process (``stall_action="exit"``): requeue the SLURM job
        first, from whichever rank stalled, by the exit policy's rules (``requeue``,
        ``max_requeues``; without a policy: batch jobs, no cap). ``record(level, event=...,
        **fields)`` writes the ``requeue`` event from the watchdog's thread. ``refused``: why a job
        these rules would requeue is not (the same stall as the attempt before)."""
        policy = self.policy
        requeue, cap = (policy.requeue, policy.max_requeues) if policy is not None else ("auto", None)
        self._requeue.run(self.job, requeue, cap, record, refused)

    def wait_before_exit(self) -> None:
        """``exit_wait`` (e.g. let SLURM record TIMEOUT, not FAILED); none after a requeue."""
        if self.policy is not None and self.policy.wait and self.requeued_by is None:
            self.watcher.sleep(self.policy.wait)
