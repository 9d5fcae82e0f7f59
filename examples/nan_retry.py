"""Non-finite gradients, retried: the step is re-run on fresh micro-batches, and the trail shows it.

    python examples/nan_retry.py --steps 40 --workspace runs/nan_retry

The model here is rigged: every ``--every``-th micro-batch (7 by default) its loss is multiplied by
``inf``, so backward gives infinite / NaN gradients. With ``max_non_finite_grad_retries=3`` the
trainer does not step those into the weights: the machine goes ACCUMULATE -> RETRY (trigger
``non_finite``), discards the gradients, logs a ``non_finite`` warning, and goes back RETRY ->
ACCUMULATE (trigger ``retry``) to run the whole step again on the next micro-batches. More than 3
retries in one step would stop the run with an error instead.

At the end it prints how many retries happened, at which steps (from the audit trail), and where the
trail is; ``trainfsm audit WORKSPACE`` lists them too.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook


def make_dataset(n: int = 1024, features: int = 32, classes: int = 4) -> TensorDataset:
    """Inputs labelled by a fixed random linear "teacher", made here (no download)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    return TensorDataset(x, (x @ teacher).argmax(1))


class FlakyTrainer(BaseTrainer):
    """A small MLP whose loss becomes ``inf`` on every ``every``-th micro-batch."""

    def __init__(self, every: int = 7, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.every = every
        self.micro_batches = 0  # forward calls so far in this process
        self.retries = 0  # steps re-run, summed from step_info by CountRetries

    def build_data_loader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(make_dataset(), batch_size=32, shuffle=True, drop_last=True)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(self.device)

    def build_optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None
        return torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def build_hooks(self) -> list[BaseHook]:
        return [CheckpointingHook(interval=20, keep_previous=1), CountRetries()]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = (t.to(self.device) for t in input)
        logits = self.model(x)  # type: ignore[misc]
        loss = nn.functional.cross_entropy(logits, y)
        self.micro_batches += 1
        if self.micro_batches % self.every == 0:
            loss = loss * float("inf")  # the "bug": every gradient becomes inf or NaN
        return loss, {"accuracy": (logits.detach().argmax(1) == y).float().mean()}


class CountRetries(BaseHook):
    """Adds up ``step_info["non_finite_grad_retry_count"]`` (how often each applied step was re-run)."""

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if isinstance(trainer, FlakyTrainer):
            trainer.retries += int(trainer.step_info.get("non_finite_grad_retry_count", 0))


def retry_transitions(trail: Path) -> list[dict[str, Any]]:
    """The trail's transitions into RETRY (trigger ``non_finite``), one per retry."""
    events = [json.loads(line) for line in trail.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("event") == "transition" and e.get("dest") == "RETRY"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    parser.add_argument("--every", type=int, default=7, help="poison every N-th micro-batch (default: 7)")
    parser.add_argument("--workspace", type=Path, default=Path("runs/nan_retry"), help="run directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(0)
    trainer = FlakyTrainer(
        every=args.every,
        max_steps=args.steps,
        max_non_finite_grad_retries=3,
        gradient_accumulation_steps=2,
        workspace=args.workspace,
        device="cpu",
    )
    trainer.train()
    trail = args.workspace / "logs" / f"events.rank{trainer.rank}.jsonl"
    retried = retry_transitions(trail)
    steps = sorted({e["step"] for e in retried})
    print(f"exit reason: {trainer.exit_reason}")
    print(f"retries: {trainer.retries} (RETRY transitions in the trail: {len(retried)}, at steps {steps})")
    print(f"audit trail: {trail}  (check it: trainfsm audit {args.workspace})")


if __name__ == "__main__":
    main()
