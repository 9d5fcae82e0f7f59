"""Exit signals at every instant of the handler, or of ``exit_wait``'s sleep, in a real process.

A ``SignalWatcher`` acting on SIGUSR1, as ``train()`` has it once the exit policy is known. A trace
function sends SIGUSR1 to this process at every line that Python runs in ``--at``:

- ``handler``: inside the first signal's handler (and whatever it calls): a second signal arrives
  at each instant of it, as in a burst from a scheduler or a user's repeated ``scancel``;
- ``sleep``: inside ``exit_wait``'s sleep (``SignalWatcher.sleep``), after a first signal made the
  exit pending: a signal arrives at each instant of the main thread's own work there.

Python runs a handler in the main thread between two instructions, so a handler that takes a lock
(a ``threading.Event``'s) waits forever when the main thread, or the handler it interrupted, holds
it. The script prints what it saw as JSON and exits ``128 + signal`` like a preempted run, at once:
the sleep is cut short by the signals.

    python tests/faults/signal_burst.py --at handler

Used by ``tests/test_signals_any_instant.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import CodeType, FrameType, SimpleNamespace
from typing import Any

from trainfsm.preemption.signals import SignalWatcher

HERE = Path(__file__).resolve()
USR1 = signal.SIGUSR1
MAX_SENT = 2000  # a bound on the burst, far above the lines either place runs


def depth(frame: FrameType | None, code: CodeType) -> int:
    """How many frames of ``code`` are on the stack from ``frame`` up."""
    count = 0
    while frame is not None:
        count += frame.f_code is code
        frame = frame.f_back
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--at", choices=("handler", "sleep"), required=True)
    parser.add_argument("--sleep", type=float, default=30.0, help="exit_wait's seconds")
    args = parser.parse_args()

    watcher = SignalWatcher(SimpleNamespace(step=3, state="EXIT"))
    watcher.install([USR1])
    watcher.decide([USR1])
    handler = signal.getsignal(USR1).__func__.__code__  # type: ignore[union-attr]
    sleep = SignalWatcher.sleep.__code__
    sent = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal sent
        if event == "line" and sent < MAX_SENT:
            handlers = depth(frame, handler)
            inside = handlers == 1 if args.at == "handler" else handlers == 0 and depth(frame, sleep) > 0
            if inside:
                sent += 1
                os.kill(os.getpid(), USR1)
        return trace

    if args.at == "handler":
        sys.settrace(trace)
        os.kill(os.getpid(), USR1)  # the first; a second comes at each line of its handler
        sys.settrace(None)
        started = time.monotonic()
    else:
        os.kill(os.getpid(), USR1)  # the exit is pending; now exit_wait
        started = time.monotonic()
        sys.settrace(trace)
        watcher.sleep(args.sleep)
        sys.settrace(None)
    print(
        json.dumps({"sent": sent, "received": len(watcher.received), "slept": round(time.monotonic() - started, 3)}),
        flush=True,
    )
    sys.exit(128 + watcher.pending)


if __name__ == "__main__":
    main()
