"""A training job for a preemption by a higher-priority job: its steps take ``--step-seconds`` in
the job's first attempt (``SLURM_RESTART_COUNT`` 0 or unset) and ``--resumed-step-seconds`` once
SLURM restarted it, so that a trial can make the preempted attempt's steps as long as a real job's
(longer than the grace time leaves after the preemption) and still end in seconds after the resume.

The exit signals are ``CheckpointingHook``'s defaults (SIGTERM, then SIGUSR1): SIGUSR1 is the
job's ``--signal`` (sent at the preemption when the admin set ``preempt_send_user_signal``), SIGTERM
SLURM's kill, and a preemption the trainer reads in the job's ``PreemptTime`` leaves as SIGTERM.
Without SLURM it is the same training, uninterrupted. The final parameters go to
``WORKSPACE/final.pt``.

Used by ``tests/slurm/test_preempted_by_job.py``.
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
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.1, help="a step's sleep in the first attempt")
    parser.add_argument("--resumed-step-seconds", type=float, default=0.0, help="once SLURM restarted the job")
    args = parser.parse_args(argv)

    import torch
    from tiny_job import TinyJobTrainer
    from torch import nn

    from trainfsm import CheckpointingHook

    first_attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0
    step_seconds = args.step_seconds if first_attempt else args.resumed_step_seconds

    class Trainer(TinyJobTrainer):
        def build_hooks(self) -> list[Any]:
            return [CheckpointingHook(interval=args.interval)]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            if step_seconds:
                time.sleep(step_seconds)  # the step's work
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    trainer = Trainer(max_steps=args.steps, workspace=args.workspace, device="cpu")
    trainer.train()  # preempted: checkpoint, requeue, SystemExit(128 + signal)
    final = {k: v.detach() for k, v in trainer.model.state_dict().items()}  # type: ignore[union-attr]
    torch.save(final, args.workspace / "final.pt")


if __name__ == "__main__":
    main()
