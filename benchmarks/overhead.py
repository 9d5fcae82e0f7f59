"""Per-step cost of BaseTrainer over a hand-written PyTorch loop doing the same work.

Both run in this one process, interleaved step by step: the trainer's data iterator is a generator
that, before handing the trainer its next batch, runs one step of the hand-written loop and times
it; the trainer's step time is the time between two batch requests minus that hand-written step.
Both see the same batches, the same model initialisation and the same optimizer, with one thread,
so noise from the shared machine hits both sides alike. The trainer runs with its audit trail on
(a workspace) and its default non-finite guard.

    python benchmarks/overhead.py            # both cases
    python benchmarks/overhead.py --quick    # fewer steps, for CI smoke runs

Targets (issue 2): ratio <= 1.05 (small) and <= 1.02 (medium).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from trainfsm import BaseTrainer


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, 10))


class BenchTrainer(BaseTrainer):
    def __init__(self, width: int, batches: Iterator[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.width = width
        self.batches = batches

    def build_data_loader(self) -> Any:
        return self.batches

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return make_model(self.width)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = input
        return nn.functional.cross_entropy(self.model(x), y), {}  # type: ignore[misc]


def interleaved(
    hand_step: Callable[[int], None],
    data: list[Any],
    steps: int,
    warmup: int,
    hand: list[float],
    trainer_times: list[float],
) -> Iterator[Any]:
    """The trainer's data: before each batch, one timed hand-written step. The trainer's own step
    is the time between two requests for a batch: the hand step runs outside that interval."""
    resumed = None
    for i in range(steps + warmup + 1):
        now = time.perf_counter()
        if resumed is not None and i > warmup:
            trainer_times.append(now - resumed)
        start = time.perf_counter()
        hand_step(i)
        if i >= warmup:
            hand.append(time.perf_counter() - start)
        resumed = time.perf_counter()
        yield data[i % len(data)]


def run_case(name: str, width: int, batch: int, steps: int, warmup: int) -> float:
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(batch, 784, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
        for _ in range(16)
    ]
    torch.manual_seed(0)
    model = make_model(width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def hand_step(i: int) -> None:
        x, y = data[i % 16]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    hand: list[float] = []
    trainer_times: list[float] = []
    batches = interleaved(hand_step, data, steps, warmup, hand, trainer_times)

    with tempfile.TemporaryDirectory() as workspace:
        trainer = BenchTrainer(width, batches, max_steps=steps + warmup, workspace=workspace, device="cpu")
        trainer.train()
    hand_median = statistics.median(hand)
    trainer_median = statistics.median(trainer_times)
    ratio = trainer_median / hand_median
    print(
        f"{name:<7} MLP 784-{width}-10 batch {batch:<4} steps {steps:<5} "
        f"hand {hand_median * 1e6:9.1f} us/step  trainfsm {trainer_median * 1e6:9.1f} us/step  "
        f"ratio {ratio:.3f}"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run, not a measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    small_steps, medium_steps = (200, 10) if args.quick else (4000, 600)
    small = run_case("small", 128, 32, small_steps, warmup=50)
    medium = run_case("medium", 2048, 256, medium_steps, warmup=5)
    if args.quick:
        print("quick smoke run: too few steps to compare with the targets (small <= 1.05, medium <= 1.02)")
        return
    print(
        f"targets: small <= 1.05 ({'met' if small <= 1.05 else 'MISSED'}), "
        f"medium <= 1.02 ({'met' if medium <= 1.02 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
