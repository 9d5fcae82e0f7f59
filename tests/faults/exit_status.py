"""A training script for the exit-status tests: a TinyTrainer with a CheckpointingHook (every 2
steps; its default exit signals, SIGTERM and SIGUSR1: none for SIGINT) in ``--workspace``, whose
forward call ``--at`` does ``--action``:

- ``wait``: write ``--marker``, then sleep (a test sends SIGINT there, as Ctrl-C does);
- ``exit:3``, ``exit:none``, ``exit:message``: ``raise SystemExit(3)`` / ``SystemExit()`` /
  ``SystemExit("message")`` from user code;
- ``error``: ``raise ValueError``.

Nothing catches what leaves ``train()``: the process ends as Python ends it, and the test compares
its status with the trail's exit code. Used by ``tests/test_exit_status.py``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HERE = Path(__file__).resolve()
RAISED: dict[str, BaseException] = {
    "exit:3": SystemExit(3),
    "exit:none": SystemExit(),
    "exit:message": SystemExit("giving up"),
    "error": ValueError("boom"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--at", type=int, default=3, help="the forward call (1-based) that acts")
    parser.add_argument("--action", choices=("wait", *RAISED), required=True)
    parser.add_argument("--marker", type=Path)
    args = parser.parse_args()

    from tests.helpers import TinyTrainer
    from trainfsm import CheckpointingHook

    class Trainer(TinyTrainer):
        def forward(self, input: Any) -> Any:
            if self.calls + 1 == args.at and args.action == "wait":
                args.marker.write_text("in forward")
                time.sleep(60)  # Ctrl-C's KeyboardInterrupt ends the sleep
            return super().forward(input)

    script = {args.at: RAISED[args.action]} if args.action in RAISED else {}
    # As at a terminal: Ctrl-C raises KeyboardInterrupt, even where the test runner ignores SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    Trainer(max_steps=8, workspace=args.workspace, hooks=[CheckpointingHook(interval=2)], script=script).train()


if __name__ == "__main__":
    main()
