"""Exit signals as machine transitions: record in the handler, act at the next safe point.

A scheduler's signal (SLURM's ``--signal=B:USR1@120``, a ``SIGTERM`` before a kill) can arrive at
any instant: inside a kernel launch, a checkpoint write, a collective. The handler therefore only
records which signal came, when, and in which state; it does no I/O, takes no lock and starts no
collective. The trainer looks at the record at the end of every optimizer step and, once all ranks
agree that a signal is pending, takes ``save`` to CHECKPOINT and ``finish`` to EXIT with reason
``preempted``; a signal during BUILD or RESTORE takes ``preempt`` straight to EXIT.

Across ranks a signal that reached only one rank still stops every rank at the same step: one small
all-reduce per step carries it, started when the step begins and waited for when it ends
(``trainfsm.agreement.SignalAgreement``), or, with ``loss_none_agreement=True``, it rides on the
all-reduce that agrees on each micro-batch before its backward.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any, Literal

ExitCode = int | Literal["128+signal"]


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


@dataclass(slots=True)
class Received:
    signum: int
    at: float
    step: int
    state: str


@dataclass(slots=True)
class SignalWatcher:
    """Installs the handlers (only from ``train()``), records arrivals, restores the old handlers."""

    where: Any  # the trainer: its ``step`` and ``state`` are read (never written) by the handler
    received: list[Received] = field(default_factory=list)
    pending: int = 0
    _previous: dict[int, Any] = field(default_factory=dict)
    _wake: threading.Event = field(default_factory=threading.Event)

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

    @property
    def installed_any(self) -> bool:
        return bool(self._previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only records: no I/O, no logging, no collective. The machine acts at the next safe point.
        if self.pending and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (checkpoints are atomic regardless)
        self.received.append(Received(signum, time.time(), self.where.step, self.where.state))
        if not self.pending:
            self.pending = signum
        self._wake.set()

    def take_new(self) -> list[Received]:
        """Arrivals not yet reported, for the audit trail (called from the main loop, not the handler)."""
        new, self.received = self.received, []
        return new

    def sleep(self, seconds: float) -> None:
        """``exit_wait``: a further signal cuts it short."""
        self._wake.clear()
        self._wake.wait(seconds)
