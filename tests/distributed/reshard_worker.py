"""One rank of a run that is preempted and resumed on other numbers of ranks (issue 49).

    torchrun --nproc-per-node W --signals-to-handle=SIGUSR1 tests/distributed/reshard_worker.py \
        --workspace DIR [--preempt-at STEP] [--loader dataloader|stateful --workers N]

The dataset's samples carry their index; ``forward`` appends the indices each micro-batch trained
to ``DIR/trained/rank{R}.attempt{A}.jsonl`` with the step, so a test can tell which samples every
optimizer step saw. ``global_batch_size`` is kept (accumulation = G / (W x B)) over a
``DistributedSampler`` with shuffle. ``--preempt-at S``: rank 0 sends SIGUSR1 to its torchrun agent
(which forwards it to every worker; ``--self-signal``: every rank to itself) as step S begins, so
the run saves at an agreed step and exits 138. ``--plant rank0``: the planted break of the issue
(every new rank resumes old rank 0's own position, as trainfsm did before).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook, data_order
from trainfsm.distributed import init_distributed


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x @ torch.randn(4, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Preempt(BaseHook):
    def __init__(self, at: int | None, to_self: bool) -> None:
        self.at, self.to_self = at, to_self

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.at and (self.to_self or trainer.rank == 0):
            os.kill(os.getpid() if self.to_self else os.getppid(), signal.SIGUSR1)


class Trainer(BaseTrainer):
    def __init__(self, args: argparse.Namespace, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.args = args

    def build_data_loader(self) -> Any:
        args = self.args
        dataset = Indexed(args.samples)
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=0)
        if args.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
        return DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.01)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        return [
            CheckpointingHook(
                interval=self.args.interval, data_reshard=self.args.reshard, async_save=self.args.async_save
            ),
            Preempt(self.args.preempt_at, self.args.self_signal),
        ]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y, index = input
        if self.args.micro_seconds:
            time.sleep(self.args.micro_seconds)
        trained = self.workspace / "trained"  # type: ignore[operator]
        trained.mkdir(exist_ok=True)
        with open(trained / f"rank{self.rank}.attempt{self.attempt}.jsonl", "a") as out:
            out.write(json.dumps({"step": self.step, "epoch": self.epoch, "indices": index.tolist()}) + "\n")
        return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]


def plant_rank0() -> None:
    """Today's behaviour before issue 49: every new rank continues old rank 0's own position."""
    real = data_order.continue_at

    def rank0(old: list[dict[str, Any]], new: data_order.Layout) -> data_order.Continuation:
        continuation = real(old, new)
        return data_order.Continuation({**old[0], "loader": None}, continuation.global_position, True, None)

    data_order.continue_at = rank0  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--preempt-at", type=int, default=None)
    parser.add_argument("--self-signal", action="store_true")
    parser.add_argument("--async-save", action="store_true", help="CheckpointingHook(async_save=True)")
    parser.add_argument("--micro-seconds", type=float, default=0.0, help="sleep in each forward (room for a signal)")
    parser.add_argument("--loader", choices=("dataloader", "stateful"), default="dataloader")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--reshard", choices=data_order.RESHARD_MODES, default="exact")
    parser.add_argument("--plant", choices=("rank0",), default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.plant == "rank0":
        plant_rank0()
    init_distributed("gloo")
    trainer = Trainer(args, max_steps=args.steps, global_batch_size=args.global_batch, workspace=args.workspace)
    trainer.train()


if __name__ == "__main__":
    main()
