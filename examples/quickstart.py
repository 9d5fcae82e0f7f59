"""The README's quick start, end to end, on CPU, with data it makes itself.

    python examples/quickstart.py --steps 200 --workspace runs/quickstart

Subclass ``BaseTrainer``, implement the ``build_*`` methods and ``forward``, add hooks, call
``train()``. The run writes its checkpoints to ``WORKSPACE/checkpoints`` and its audit trail to
``WORKSPACE/logs/events.rank0.jsonl``, with the loss every 10 steps; run it again to resume from
the latest checkpoint. ``trainfsm plot WORKSPACE`` then draws the run and its loss curve.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook, LoggingHook


def make_dataset(n: int = 2048, features: int = 784, classes: int = 10) -> torch.utils.data.TensorDataset:
    """Inputs labelled by a fixed random linear "teacher": learnable, and made here, not downloaded."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(1))


class MyTrainer(BaseTrainer):
    def build_data_loader(self) -> torch.utils.data.DataLoader[Any]:
        # Any iterable works (DataLoader, list, generator function's iterable, ...).
        return torch.utils.data.DataLoader(make_dataset(), batch_size=32, shuffle=True)

    def build_model(self) -> nn.Module:
        model = nn.Sequential(
            nn.Linear(784, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
        return model.to(self.device)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]

    def build_hooks(self) -> list[BaseHook]:
        return [
            CheckpointingHook(interval=100, keep_previous=1),  # under workspace/checkpoints
            LoggingHook(interval=10),  # loss, lr and records averaged over 10 steps, into the trail
            PrintLoss(interval=50),
        ]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = input  # comes from the data loader
        x, y = x.to(self.device), y.to(self.device)
        logits = self.model(x)  # type: ignore[misc]
        loss = nn.functional.cross_entropy(logits, y)
        # Return the loss and a dict of metrics. Tensors are fine (no host sync per step).
        records = {"accuracy": (logits.argmax(1) == y).float().mean()}
        return loss, records


class PrintLoss(BaseHook):
    """A custom hook: print the loss every ``interval`` steps."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if trainer.step % self.interval == 0:
            info = trainer.step_info
            print(
                # one entry per micro-batch (one here); float() reads the device: only when printing
                f"step {trainer.step:4d}/{trainer.max_steps}  loss {float(info['loss'][-1]):.4f}  "
                f"accuracy {float(info['records'][-1]['accuracy']):.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    parser.add_argument("--workspace", type=Path, default=Path("runs/quickstart"), help="run directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the application configures logging

    torch.manual_seed(0)
    trainer = MyTrainer(
        max_steps=args.steps,
        grad_clip=1.0,
        max_non_finite_grad_retries=3,
        mixed_precision=None,  # or "bf16" / "fp16"
        gradient_accumulation_steps=2,
        workspace=args.workspace,
        device="cpu",
    )
    trainer.train()
    print(f"exit reason: {trainer.exit_reason}")
    print(f"checkpoints: {args.workspace / 'checkpoints'}")
    print(f"audit trail: {args.workspace / 'logs' / 'events.rank0.jsonl'}")


if __name__ == "__main__":
    main()
