"""The stall watchdog: a rank that stops moving says so in its trail, where and in what.

A stalled multi-rank job is quiet: one rank stops (a frozen peer, a deadlocked data-loader
worker, a write on a stalled file system, user code stuck in I/O) and every other rank waits in a
collective until its timeout, or forever. The watchdog is a daemon thread per rank, started by
``train()`` once the trail is open and stopped just before it closes. The machine counts its
transitions (``trainfsm.machine.Progress``: one attribute write per transition, nothing else on
the step's path); the thread reads that count ``TICKS_PER_SECOND`` times a second. When the count
stays the same for longer than the state's budget, it writes a ``stall`` event at once (state, step,
micro-batch, seconds, and what the main thread is doing, read from its stack by
``trainfsm.activity``; the first report writes out the records the stuck thread had queued, so the
trail reaches the step the stall names), again at 2x, 4x, ... the budget, and ``stall_cleared`` when the rank moves
again. With ``stall_action="exit"`` the first report is followed by a requeue under SLURM (the
preemption's rules) and the end of the process with ``STALL_EXIT_CODE``, so ``torchrun
--max-restarts`` or the requeued job resumes from the newest checkpoint; unless the attempt before
ended in a stall in the same state at the same step, where the next would stall again: then the
job is not requeued (the ``exit`` event's ``repeats``). No step of that exit waits on what the
stuck thread may hold (``EXIT_WRITE_SECONDS``, ``EXIT_DEADLINE_SECONDS``).

Budgets (``stall_timeout="auto"``; a number of seconds is one budget for every state), chosen so
that a slow but healthy rank is never reported (``AutoBudgets``):

- BUILD, RESTORE, EXIT and the first step of a launch: ``AUTO.build`` etc., 10 minutes (RESTORE,
  and EXIT while it waits for an asynchronous save's write: or the state's bytes at 20 MB/s, if
  longer). Nothing has been measured yet; these are where datasets download, checkpoints load,
  kernels compile and the last uploads run.
- A step (STEP, ACCUMULATE, RETRY): ``max(2 minutes, 10 x the slowest of the last 100 steps)``,
  steps as the watchdog saw them (a step longer than a tick on its own, shorter ones as the mean
  of those between two looks). A validation or a save 5x slower than a step stays
  under it; one slower than that and than 2 minutes is reported, and cleared when it ends.
- An evaluation (the hooks' ``on_evaluate``, at a step's end; ``Progress.evaluating``): the step's
  budget, or ``AUTO.first_evaluation`` (10 minutes) for the first of a launch, then
  ``10 x the slowest evaluation`` if longer: learned like the steps, apart from them.
- CHECKPOINT: ``max(5 minutes, 4 x the slowest earlier save, the state's bytes at 20 MB/s, 10 x
  the slowest step)``: a save's time grows with its bytes and the file system's worst days.

Times are the watchdog's, to a tick: it learns of a transition at its next look, so ``seconds``
(since the last transition) may be up to a tick short, and a stall is reported at most two ticks
past the budget. ``stall_timeout=None`` reports no stall.

The same thread watches the job's end (``trainfsm.preemption.deadline``): under SLURM with a time
limit, rank 0's thread compares the time left with the steps and saves it measured, at each look,
and raises the preemption's pending signal when the way out no longer fits. The thread runs when
either is wanted; with ``stall_timeout=None`` and no deadline to watch, ``train()`` starts none.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch

from trainfsm import activity
from trainfsm import machine as fsm
from trainfsm.machine import STALL_EXIT_CODE, ExitReason
from trainfsm.preemption.deadline import UNMEASURED_SAVE_BYTES_PER_SECOND
from trainfsm.trail.writer import render_console

if TYPE_CHECKING:
    from trainfsm.checkpoint.background import WriteTimes
    from trainfsm.machine import Progress
    from trainfsm.preemption.deadline import Deadline
    from trainfsm.trail.writer import EventLog

#: How often the thread looks at the progress mark; a stall is reported at most a tick late.
TICKS_PER_SECOND: Final = 4

#: ``stall_action="exit"``: the stuck thread may hold what the exit writes to (a full stderr pipe,
#: a trail on a stalled file system), so each write waits at most ``EXIT_WRITE_SECONDS`` on a
#: thread of its own, and the process ends ``EXIT_DEADLINE_SECONDS`` after the stall's report
#: whatever still waits (the requeue's ``scontrol`` has 30 s of it).
EXIT_WRITE_SECONDS: Final = 3.0
EXIT_DEADLINE_SECONDS: Final = 60.0


@dataclass(frozen=True, slots=True)
class AutoBudgets:
    """``stall_timeout="auto"``: seconds per state (see the module's docstring for why)."""

    build: float = 600.0
    restore: float = 600.0
    first_step: float = 600.0
    step_floor: float = 120.0
    step_multiple: float = 10.0
    step_window: int = 100
    first_evaluation: float = 600.0
    evaluation_multiple: float = 10.0
    checkpoint_floor: float = 300.0
    checkpoint_multiple: float = 4.0
    checkpoint_bytes_per_second: float = 20e6
    exit: float = 600.0


AUTO = AutoBudgets()

_STEPPING: Final = frozenset({fsm.STEP, fsm.ACCUMULATE, fsm.RETRY})
#: Where the job's end is watched: training, an interval's save included.
_WAY_OUT: Final = _STEPPING | {fsm.CHECKPOINT}


class Watchdog:
    """One rank's watchdog thread (``start`` / ``stop``); see the module's docstring."""

    def __init__(
        self,
        *,
        timeout: float | str | None,
        action: str,
        progress: Progress,
        trainer: Any,
        event_log: EventLog,
        micro: Callable[[], int],
        requeue: Callable[[Callable[..., None], str | None], None],
        exit: Callable[[int], None] = os._exit,
        deadline: Deadline | None = None,
        on_deadline: Callable[[dict[str, Any]], bool] | None = None,
        writes: Callable[[], tuple[WriteTimes, ...]] = tuple,
    ) -> None:
        self.stalls = timeout is not None  # None: only the job's end is watched
        self.fixed = None if timeout in ("auto", None) else float(timeout)
        self.action = action
        self.progress = progress
        self.trainer = trainer
        self.event_log = event_log
        self.micro = micro
        # Under SLURM: the preemption's requeue, its cap and array rules; it records its ``requeue``
        # event with the callable it is given, and refuses with the reason it is given.
        self.requeue = requeue
        self._exit = exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # What the thread has seen: the mark, when it last moved, where the trainer was then.
        self._moves = -1
        self._since = 0.0
        self._state = fsm.BUILD
        self._step = 0
        self._reports = 0
        self._steps: deque[float] = deque(maxlen=AUTO.step_window)  # seconds per observed step
        self._evaluations: deque[float] = deque(maxlen=AUTO.step_window)  # seconds per observed evaluation
        self._evaluation_began: float | None = None
        self._step_began: float | None = None
        self._saves: list[float] = []
        self._save_began: float | None = None
        self._bytes: int | None = None  # the state's size, measured once, when a save runs long
        # The job's end (rank 0 under SLURM with a time limit): checked at each look until raised.
        self.deadline = deadline
        self.on_deadline = on_deadline
        self.writes = writes  # asynchronous saves' own clocks: their writes come after CHECKPOINT

    # ---------------------------------------------------------------- lifetime
    def start(self) -> None:
        self._moves, self._since = self.progress.moves, time.monotonic()
        self._state, self._step = self.trainer.state, self.trainer.step
        self._thread = threading.Thread(target=self._watch, name="trainfsm-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread. Called by the trainer's thread, which is therefore not stuck: a stall
        reported and not yet cleared is cleared now (one in EXIT has no transition to end it), so the
        trail never ends in a stall the rank got out of. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._reports:
            self._moves = -1  # moved: the caller is the thread that was stuck
            self.look(time.monotonic())

    def stalled_for(self) -> float | None:
        """Seconds this rank has been stuck, when a stall was reported and it has not moved since
        (the trainer's thread, as a collective fails: the note points at the stall); else None."""
        if not self._reports:
            return None
        return time.monotonic() - self._since

    def _watch(self) -> None:
        wait = self._stop.wait
        tick = 1.0 / TICKS_PER_SECOND
        while not wait(tick):
            try:
                self.look(time.monotonic())
            except Exception as exc:  # a watchdog that fails must not end the run: say so, stop watching
                self.event_log.console.warning("trainfsm: the stall watchdog stopped: %r", exc)
                return

    # ---------------------------------------------------------------- one look
    def look(self, now: float) -> None:
        """Compare the mark with the last look: learn from a move, report a stall."""
        moves, evaluating = self.progress.moves, self.progress.evaluating
        trainer = self.trainer
        self._time_evaluation(now, evaluating, moves != self._moves)
        if moves != self._moves:
            state, step = trainer.state, trainer.step
            if self._reports:
                self.event_log.write_from_thread(
                    "info",
                    "stall_cleared",
                    step,
                    state,
                    seconds=round(now - self._since, 3),
                    reports=self._reports,
                    stalled_state=self._state,
                    stalled_step=self._step,
                )
            self._learn(now, state, step)
            self._moves, self._since, self._state, self._step, self._reports = moves, now, state, step, 0
        elif self.stalls:
            stuck = now - self._since
            budget = self.budget(self._state, stuck, evaluating)
            if stuck >= budget * (1 << self._reports):
                self._report(stuck, budget)
        if self.deadline is not None:
            self._look_at_deadline()

    def _look_at_deadline(self) -> None:
        """Raise the preemption's pending signal once the way out no longer fits before the job's end."""
        if not self._steps or self._state not in _WAY_OUT:  # nothing measured yet, or not training
            return
        now, clocks = time.time(), self.writes()
        write = 0.0  # an asynchronous save: CHECKPOINT stages it, EXIT waits for its write
        for clock in clocks:
            needs, first = clock.unwritten(now)  # the save's write, and the rest of one in flight
            write += needs + first
        # An asynchronous CHECKPOINT is over in milliseconds, often between two looks: its writes
        # say whether a save was measured (one still in flight, the first, was not: the estimate).
        measured = all(clock.slowest for clock in clocks) if clocks else bool(self._saves)
        if measured:
            save = max(self._saves, default=0.0)
        else:
            if self._bytes is None:
                self._bytes = state_bytes(self.trainer)
            save = self._bytes / UNMEASURED_SAVE_BYTES_PER_SECOND
        figures = self.deadline.due(now, max(self._steps), save, measured, write)  # type: ignore[union-attr]
        if figures is not None:
            self.deadline = None  # once: raised now, or a signal already pending takes the same way out
            if self.on_deadline is not None:
                self.on_deadline(figures)

    def _learn(self, now: float, state: str, step: int) -> None:
        if step > self._step and state in _STEPPING:  # a step began: the ones before it ended
            if self._step_began is not None:  # several steps between two looks: their mean
                self._steps.append((now - self._step_began) / (step - self._step))
            self._step_began = now
        if state == fsm.CHECKPOINT and self._state != fsm.CHECKPOINT:
            self._save_began = now
        elif state != fsm.CHECKPOINT and self._save_began is not None:
            self._saves.append(now - self._save_began)
            self._save_began = None

    def _time_evaluation(self, now: float, evaluating: bool, moved: bool) -> None:
        """An evaluation as the watchdog sees it: from its first look inside one to its first look
        past it (a transition since the last look ends one: an evaluation makes none)."""
        if self._evaluation_began is not None and (moved or not evaluating):
            self._evaluations.append(now - self._evaluation_began)
            self._evaluation_began = None
        if evaluating and self._evaluation_began is None:
            self._evaluation_began = now

    def budget(self, state: str, stuck: float = 0.0, evaluating: bool = False) -> float:
        """Seconds this state may go without a transition (``stuck``: how long it has;
        ``evaluating``: the trainer is in the hooks' ``on_evaluate``, at a step's end)."""
        if self.fixed is not None:
            return self.fixed
        auto = AUTO
        if state in _STEPPING:
            step = auto.first_step if not self._steps else max(auto.step_floor, auto.step_multiple * max(self._steps))
            if evaluating:  # learned like the steps, apart from them: a first one has nothing to go by
                evaluation = auto.evaluation_multiple * max(self._evaluations, default=0.0)
                return max(step, evaluation if self._evaluations else auto.first_evaluation)
            return step
        if state == fsm.CHECKPOINT:  # at least a step's budget: a first save has nothing else to go by
            budget = max(
                auto.checkpoint_floor,
                auto.checkpoint_multiple * max(self._saves, default=0.0),
                auto.step_multiple * max(self._steps, default=0.0),
            )
            return self._with_bytes(budget, stuck)
        if state == fsm.BUILD:
            return auto.build
        if state == fsm.RESTORE:  # a checkpoint that loads slowly because it is large is not a stall
            return self._with_bytes(auto.restore, stuck)
        if any(clock.began is not None for clock in self.writes()):
            # EXIT waits for an asynchronous save's write in flight (the exit's own save's among
            # them): a large state written slowly is no stall, or its exit would lose that save.
            # Without one, a hang in EXIT (a barrier, an upload) has EXIT's budget alone.
            return self._with_bytes(auto.exit, stuck)
        return auto.exit

    def _with_bytes(self, budget: float, stuck: float) -> float:
        """``budget``, or the time the state's bytes take at the slowest rate we plan for, if longer
        (measured once, and only once a save or load has run past ``budget``)."""
        if stuck < budget:
            return budget
        if self._bytes is None:
            self._bytes = state_bytes(self.trainer)
        return max(budget, self._bytes / AUTO.checkpoint_bytes_per_second)

    def _report(self, stuck: float, budget: float) -> None:
        self._reports += 1
        doing = activity.main_thread_activity()
        try:
            micro = self.micro()
        except Exception:
            micro = None
        stall = {
            "micro": micro,
            "seconds": round(stuck, 3),
            "budget": round(budget, 3),
            "report": self._reports,
            "action": self.action,
            **doing.as_event(),
        }
        if self.action == "exit":
            self._end(STALL_EXIT_CODE, stall)
        else:
            if self._reports == 1:  # the trail up to where it stuck first, as the exit does: one step number
                _within(EXIT_WRITE_SECONDS, self._write_out)
            self.event_log.write_from_thread("warning", "stall", self._step, self._state, **stall)

    def _write_out(self) -> None:
        """What the stuck thread recorded and had not written yet (its last steps, the step in flight),
        so the trail reaches the step the stall names. The lock's wait is bounded (a trainer's thread
        stuck in a write of its own holds it: nothing is written out) and the lock is handed back on
        this thread, after the write, however long a stalled file system makes it take."""
        if self.event_log.write_out_before_exit(EXIT_WRITE_SECONDS / 2):
            self.event_log.hand_back()

    def _end(self, code: int, stall: dict[str, Any]) -> None:
        """Write out what the stuck thread recorded, the stall, requeue under SLURM, record the
        exit, end the process: the main thread is stuck, so nothing of EXIT runs (a checkpoint in
        the making is left as a ``.tmp-*`` that the next RESTORE removes). No step here waits on
        what the stuck thread may hold (``EXIT_WRITE_SECONDS``, ``EXIT_DEADLINE_SECONDS``)."""
        deadline = threading.Timer(EXIT_DEADLINE_SECONDS, self._exit, (code,))
        deadline.daemon = True
        deadline.start()
        words = _LastWords(self.event_log, self._step, self._state)
        words.write_out()
        words.record("warning", "stall", **stall)
        repeats = self._repeats()
        refused = None
        if repeats is not None:
            refused = (
                f"the same stall ({self._state} at step {self._step}) ended attempt {repeats}; "
                "a requeue would resume from the same checkpoint and stall there again"
            )
        try:
            self.requeue(words.record, refused)
        except Exception as exc:
            words.console.append((logging.ERROR, f"trainfsm: requeue after a stall failed: {exc!r}"))
        self.trainer.exit_reason, self.trainer.exit_code = ExitReason.STALLED, code
        words.record("error", "exit", reason=ExitReason.STALLED, code=code, repeats=repeats)
        words.show()
        self._exit(code)
        deadline.cancel()  # reached only where ``exit`` returns (tests)
        self.event_log.hand_back()

    def _repeats(self) -> int | None:
        """The attempt before this one, when the stall exit ended it in this state at this step:
        the next attempt would resume from the same checkpoint and stall there again."""
        end = self.event_log.previous_end
        if end is None or (end.get("event"), end.get("reason")) != ("exit", ExitReason.STALLED):
            return None
        if (end.get("step"), end.get("state")) != (self._step, self._state):
            return None
        return int(end["attempt"])


class _LastWords:
    """What the stall exit writes, none of it waiting on the stuck thread: each trail line on a
    thread of its own for at most ``EXIT_WRITE_SECONDS`` (none after one that did not finish:
    its file is the stuck one), and the console's lines last, all at once, in the same bound (a
    full pipe on stderr holds the console, not the trail)."""

    def __init__(self, event_log: EventLog, step: int, state: str) -> None:
        self.log, self.step, self.state = event_log, step, state
        self.trail = True  # the trail's file still takes lines
        self.console: list[tuple[int, str]] = []

    def write_out(self) -> None:
        """What the stuck thread recorded and had not written yet: the trail up to where it stuck."""
        # The lock's wait ends first: a trainer's thread that holds it (stuck in a console line of its
        # own) leaves the trail's file free for the lines that follow.
        self.trail = _within(EXIT_WRITE_SECONDS, lambda: self.log.write_out_before_exit(EXIT_WRITE_SECONDS / 2))

    def record(self, level: str, event: str, **fields: Any) -> None:
        record = self.log.thread_record(event, self.step, self.state, **fields)
        if self.trail:
            self.trail = _within(EXIT_WRITE_SECONDS, lambda: self.log.write_line(record))
        self.console.append((logging.getLevelName(level.upper()), render_console(record)))

    def show(self) -> None:
        console = self.log.console

        def show_and_flush() -> None:
            for levelno, text in self.console:
                if console.isEnabledFor(levelno):
                    console.log(levelno, "%s", text)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()

        _within(EXIT_WRITE_SECONDS, show_and_flush)


def _within(seconds: float, work: Callable[[], object]) -> bool:
    """Run ``work`` on a daemon thread and wait for it at most ``seconds``: whether it finished. A
    ``work`` that blocks stays blocked on its own thread, which the process's end takes with it."""
    thread = threading.Thread(target=work, name="trainfsm-watchdog-exit", daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def state_bytes(trainer: Any) -> int:
    """The model's and optimizer's tensors in bytes (what a save writes, roughly)."""
    total = 0
    try:
        model, optimizer = trainer.model, trainer.optimizer
        tensors: Any = itertools.chain(model.parameters(), model.buffers()) if model is not None else ()
        if optimizer is not None:
            tensors = itertools.chain(
                tensors, (v for s in list(optimizer.state.values()) for v in s.values() if isinstance(v, torch.Tensor))
            )
        for tensor in tensors:
            total += tensor.numel() * tensor.element_size()
    except Exception:  # the main thread changed it under us: what was counted
        pass
    return total
