"""The signal handlers of one ``train()``: install, record, hold until the exit policy is known,
pass on what it does not name, restore; and, under torchrun, the parent-death signal.

``trainfsm.preemption.policy.Preemption`` owns a ``SignalWatcher`` and decides what an arrival means; this
module only records. A scheduler's signal can arrive at any instant (inside a kernel launch, a
checkpoint write, a collective), so the handler does no I/O, takes no lock and starts no
collective: it records which signal came, when, at which step and in which state (and, during
``exit_wait``, writes one byte to a pipe that wakes the wait).

From the first line of ``train()`` to its last no exit signal is lost. The policy (which signals,
which code) may come from ``CheckpointingHook(exit_signals=...)``, known only once
``build_hooks()`` returned, but a scheduler may signal while the model is still being built. So
``train()`` first *holds* the signals schedulers send (``HELD_SIGNALS``: SIGTERM, SIGUSR1, SIGUSR2)
and any that ``set_exit_signals()`` named: their arrivals are recorded, nothing acts yet. Once the
policy is known (``SignalWatcher.decide``), a held signal it names becomes pending (BUILD then
takes ``preempt``), and every other held signal gets back the disposition it had before ``train()``
and, if it arrived meanwhile, is raised again: it kills the process, is ignored or runs the user's
handler, as it would have without trainfsm, only later. SIGINT is held only when
``set_exit_signals()`` names it, so that Ctrl-C during a long build is not delayed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

from trainfsm.preemption.torchelastic import is_worker, under_torchrun

#: Held from the first line of ``train()`` until the exit policy is known: the signals schedulers
#: send before a kill (SLURM's ``--signal``, ``scancel``, preemption, torchrun's forwarding).
HELD_SIGNALS: Final[tuple[signal.Signals, ...]] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

#: Set in ``SignalWatcher.pending`` beside the exit signal's number when the job's end, not a
#: signal, ends the run (``trainfsm.preemption.deadline``): the number travels in the same
#: agreements as a signal's, and every rank can tell. ``pending & SIGNAL_BITS`` is the signal.
DEADLINE: Final = 0x100
#: With ``DEADLINE``: it was SLURM's preemption (a ``PreemptTime`` rank 0 saw), not the job's end.
PREEMPTED: Final = 0x200
SIGNAL_BITS: Final = 0xFF

#: Reported at ``run_start`` when ignored, blocked or pending as ``train()`` begins.
REPORTED_SIGNALS: Final[tuple[signal.Signals, ...]] = (signal.SIGHUP, signal.SIGINT, *HELD_SIGNALS)


_PR_SET_PDEATHSIG: Final = 1
_PR_GET_PDEATHSIG: Final = 2


def on_launcher_death(sig: signal.Signals) -> int | None:
    """Under torchrun, have the kernel send ``sig`` to this worker when its launcher dies; returns
    the previous parent-death signal (to restore at EXIT), or None where nothing was set.

    torchrun handles only the signals in ``--signals-to-handle`` (by default SIGTERM, SIGINT,
    SIGHUP, SIGQUIT) and forwards those to its workers; any other signal that kills it, such as
    SLURM's SIGUSR1 to an ``exec torchrun`` batch script, leaves its workers training as orphans,
    with nobody to checkpoint or requeue. With this they get ``sig`` (SIGTERM: a preemption by
    default) the moment the launcher dies. Linux only (``prctl``); a no-op outside torchrun.
    """
    if sys.platform != "linux" or not under_torchrun():
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    previous = ctypes.c_int(0)
    if libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(previous), 0, 0, 0) != 0:
        return None
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return None
    return previous.value


def restore_launcher_death(previous: int | None) -> None:
    if previous is None:
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, previous, 0, 0, 0)


def stop_launcher_at_exit(sig: signal.Signals) -> int | None:
    """Under torchrun, send ``sig`` to this worker's agent as this process ends; returns the
    agent's pid, or None where there is no agent to stop (outside torchrun, or a parent that is
    not the agent: a wrapper script started by ``torchrun --no-python``).

    Why: a rank that leaves for a preemption signalled to another node exits with the preemption
    code, and its own agent, which received no signal, counts that as a failure and restarts it
    into a group the preempted node never rejoins: it then waits in the rendezvous for its join
    timeout (10 minutes by default). Stopped with the signal it would have received from the
    scheduler, the agent ends as the preempted node's does. Sent at the very end of the process
    (``atexit``), after the user's code after ``train()`` has run, because the agent answers by
    sending SIGTERM to its workers.
    """
    if not under_torchrun():
        return None
    agent = os.getppid()
    if is_worker(agent) is not False:  # the agent runs without torchrun's worker variables
        return None
    atexit.register(_signal_launcher, agent, int(sig))
    return agent


def _signal_launcher(pid: int, sig: int) -> None:
    if os.getppid() == pid:  # still our agent (not a reused pid after its death)
        os.kill(pid, sig)


@dataclass(slots=True)
class Received:
    signum: int
    at: float
    step: int
    state: str


def state_at_start(signals: Iterable[signal.Signals]) -> dict[str, list[str]]:
    """Which of ``signals`` were ignored, blocked or already pending when ``train()`` began.

    An ignored signal (``nohup``; bash ignores SIGINT for background jobs) still reaches trainfsm's
    handler once installed; a blocked one never arrives while it stays blocked, whatever handler
    is installed; a pending one is blocked and already sent.
    """
    wanted = list(dict.fromkeys(signals))
    ignored = [s.name for s in wanted if signal.getsignal(s) is signal.SIG_IGN]
    blocked: list[str] = []
    pending: list[str] = []
    if hasattr(signal, "pthread_sigmask"):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        blocked = [s.name for s in wanted if s in mask]
        arrived = signal.sigpending()
        pending = [s.name for s in wanted if s in arrived]
    return {"ignored": ignored, "blocked": blocked, "pending": pending}


def hold_interrupt() -> list[int] | None:
    """While ``train()`` sets up its machine (milliseconds), a Ctrl-C that would raise
    KeyboardInterrupt (Python's default SIGINT handler) is noted instead, and raised by
    ``release_interrupt`` once the machine can record it. None (nothing held) when SIGINT has
    another handler, or outside the main thread. A signal mask would not do: a process-directed
    SIGINT goes to any thread that does not block it, and Python then raises in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    arrived: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: arrived.append(signum))
    return arrived


def release_interrupt(held: list[int] | None) -> None:
    """Python's SIGINT handler back; a Ctrl-C that came while held is raised here."""
    if held is None:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def disposition(handler: Any) -> str:
    """How a signal's handler before ``train()`` treats it: ``default``, ``ignored`` or ``handler``."""
    if handler is signal.SIG_IGN:
        return "ignored"
    if handler is signal.SIG_DFL or handler is None:
        return "default"
    return "handler"


@dataclass(slots=True)
class SignalWatcher:
    """Installs the handlers (only from ``train()``), records arrivals, restores the old handlers.

    Until ``decide`` is called with the exit policy's signals, arrivals are only held (recorded,
    not pending); after it, a named signal's arrival is pending at once.
    """

    where: Any  # the trainer: its ``step`` and ``state`` are read (never written) by the handler
    received: list[Received] = field(default_factory=list)
    pending: int = 0
    #: The signals that end training, once the exit policy is known; None while signals are held.
    acting: frozenset[int] | None = None
    _previous: dict[int, Any] = field(default_factory=dict)
    #: The write end of the pipe ``sleep`` waits on while it waits (-1 otherwise): the handler's
    #: way to wake it without a lock.
    _wake: int = -1

    def install(self, signals: Iterable[signal.Signals]) -> list[signal.Signals]:
        """Install handlers for ``signals`` not yet handled; returns those newly installed.

        Python delivers signals to the main thread only; elsewhere nothing can be installed and the
        caller records that.
        """
        if threading.current_thread() is not threading.main_thread():
            return []
        added = []
        for sig in signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
                added.append(sig)
        return added

    def decide(self, signals: Iterable[signal.Signals]) -> list[tuple[Received, str]]:
        """The exit policy is known: act on ``signals`` from now on, hand every other held signal
        back to its old disposition. Returns the held arrivals of those others, each with the
        disposition it goes back to, for the caller to record and raise again (in that order)."""
        acting = frozenset(signals)
        self.install(acting)
        passed_on: list[tuple[Received, str]] = []
        for sig in [s for s in self._previous if s not in acting]:
            previous = self._previous.pop(sig)
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            how = disposition(previous)
            passed_on += [(r, how) for r in self.received if r.signum == sig]
        self.received = [r for r in self.received if r.signum in acting]
        self.acting = acting
        if self.received and not self.pending:
            self.pending = self.received[0].signum
        passed_on.sort(key=lambda item: item[0].at)
        return passed_on

    @property
    def installed_any(self) -> bool:
        return bool(self._previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only records: no I/O, no logging, no collective, no lock. The machine acts at the next
        # safe point. Python runs this in the main thread between two of its instructions, so any
        # lock it took (a threading.Event's) could be held by the code it interrupted (the main
        # thread in ``sleep``, or this handler itself when a second signal arrives inside it): a
        # deadlock until SIGKILL. Plain attribute writes, a list append and a pipe write take none.
        if self.pending and not self.pending & DEADLINE and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (checkpoints are atomic regardless)
        where = self.where
        # Before the machine exists (the first lines of train()) the trainer has no state yet.
        self.received.append(Received(signum, time.time(), where.step, getattr(where, "state", "BUILD")))
        if not self.pending and self.acting is not None and signum in self.acting:
            self.pending = signum
        wake = self._wake
        if wake >= 0:  # inside ``sleep``: wake it (a full pipe, in a burst, wakes it already)
            with contextlib.suppress(OSError):
                os.write(wake, b"\0")

    def raise_deadline(self, signum: int, preempted: bool = False) -> bool:
        """From the watchdog's thread: the job's end is near; pending from now on as if ``signum``
        had arrived, with the ``DEADLINE`` bit (nothing is added to ``received``). False when a
        signal is already pending: it takes the same way out."""
        if self.pending:
            return False
        # One attribute write: the handler and the main loop read it. The bits travel in the agreement.
        self.pending = DEADLINE | (PREEMPTED if preempted else 0) | signum
        return True  # nothing to wake: ``sleep`` runs only with an exit pending, when this returns False

    def take_new(self) -> list[Received]:
        """Arrivals not yet reported, for the audit trail (called from the main loop, not the handler)."""
        new, self.received = self.received, []
        return new

    def wait_for_arrival(self, seconds: float) -> None:
        """Until a signal not yet reported (``take_new``) has arrived, ``seconds`` at most."""
        self.sleep(seconds, arrival=True)

    def sleep(self, seconds: float, arrival: bool = False) -> None:
        """``exit_wait``: a further signal cuts it short.

        A pipe that lives only while this waits: the handler writes a byte to it and ``poll``
        returns (a signal interrupts ``poll``; Python runs the handler, then polls again and finds
        the byte). Not ``signal.set_wakeup_fd``: that is the process's one slot, which asyncio and
        the user's code may hold. Not ``select.select``: it refuses descriptors past 1023, which a
        process with many open files has.
        """
        read, write = os.pipe()
        try:
            os.set_blocking(write, False)  # the handler must never block on a full pipe
            poller = select.poll()
            poller.register(read, select.POLLIN)
            self._wake = write
            if not (arrival and self.received):  # with ``arrival``: one came before the pipe was there
                poller.poll(seconds * 1000.0)
        finally:
            self._wake = -1  # first: a handler run from here on writes nothing to a closed pipe
            os.close(read)
            os.close(write)
