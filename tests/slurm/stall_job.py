"""A training job whose forward blocks at one step in a SLURM job's first attempt, for the stall watchdog.

``--stall-at STEP`` makes ``forward`` sleep ``--stall-seconds`` (far longer than the test waits) at
that step when ``SLURM_RESTART_COUNT`` is 0 or unset: the watchdog (``--stall-timeout`` seconds,
``stall_action="exit"``) reports the stall, requeues the job and ends the process with 75; the
requeued attempt (``SLURM_RESTART_COUNT=1``) resumes from the newest checkpoint and does not block.
Without ``--stall-at`` it is the same training, uninterrupted. The final parameters go to ``--out``.

Used by ``tests/slurm/test_stall.py``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--stall-at", type=int, help="the step whose forward blocks in the first attempt")
    parser.add_argument("--stall-seconds", type=float, default=600.0)
    parser.add_argument("--stall-timeout", type=float, default=5.0)
    args = parser.parse_args(argv)

    import torch
    from tiny_job import TinyJobTrainer
    from torch import nn

    from trainfsm import CheckpointingHook

    first_attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0

    class Trainer(TinyJobTrainer):
        def build_hooks(self) -> list[Any]:
            return [CheckpointingHook(interval=args.interval)]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            if first_attempt and self.step == args.stall_at:
                time.sleep(args.stall_seconds)  # the stall: only the watchdog ends it
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    # A fixed stall_timeout is the budget of BUILD too, and the first optimizer a process builds
    # imports torch._dynamo: 2 to 4 s on a busy 2-core machine. Paid here, before train(), a
    # budget of a few seconds is the stall's alone.
    torch.optim.Adam(nn.Linear(1, 1).parameters())
    torch.manual_seed(1234)
    trainer = Trainer(
        max_steps=args.steps,
        workspace=args.workspace,
        device="cpu",
        stall_timeout=args.stall_timeout,
        stall_action="exit",
    )
    trainer.train()
    torch.save([p.detach() for p in trainer.model.parameters()], args.out)  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
