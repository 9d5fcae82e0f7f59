"""A preemptible training job: checkpoints on SIGUSR1/SIGTERM, requeues itself, resumes exactly.

Run it under SLURM with ``sbatch examples/slurm/train.sbatch`` (see README.md here), or directly:
``python examples/slurm/train.py --workspace runs/slurm --steps 60``. The same command resumes from
the workspace's latest checkpoint, so a requeued job just runs it again.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainfsm import BaseTrainer, CheckpointingHook


class RegressionTrainer(BaseTrainer):
    """A small deterministic MLP regression; ``step_seconds`` stands in for real work per step."""

    def __init__(self, step_seconds: float = 0.0, interval: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_seconds = step_seconds
        self.interval = interval

    def build_data_loader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        return [
            CheckpointingHook(
                interval=self.interval,
                keep_previous=1,
                # SIGUSR1: SLURM's warning before the time limit (--signal=B:USR1@120);
                # SIGTERM: scancel, preemption, or the kill at the time limit.
                exit_signals=[signal.SIGUSR1, signal.SIGTERM],
                requeue="auto",  # scontrol requeue, only inside a SLURM batch job
                max_requeues=20,
            )
        ]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        x, y = input
        return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workspace", type=Path, default=Path("runs/slurm"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step, to make room for signals")
    parser.add_argument(
        "--stall-action",
        choices=("record", "exit"),
        default="record",
        help="on a stall (no progress past the watchdog's budget): record it and keep waiting, or record it, "
        "requeue the SLURM job and exit 75",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trainer = RegressionTrainer(
        step_seconds=args.step_seconds,
        interval=args.interval,
        max_steps=args.steps,
        workspace=args.workspace,
        device="cpu",
        stall_action=args.stall_action,
    )
    trainer.train()  # on a signal: checkpoint, requeue, SystemExit(128 + signal)
    torch.save({k: v.detach() for k, v in trainer.model.state_dict().items()}, args.workspace / "final.pt")  # type: ignore[union-attr]
    print(f"done: {args.steps} steps; final parameters in {args.workspace / 'final.pt'}", flush=True)


if __name__ == "__main__":
    main()
