"""One rank of a DDP run written as a trainloop user writes it, on ``trainloop`` or on ``trainfsm``.

    python tests/distributed/trainloop_worker.py --out DIR --run PACKAGE:WORKSPACE:MAX_STEPS [--run ...]

Each ``--run`` trains ``user_trainer`` of ``PACKAGE`` (``trainloop`` or ``trainfsm``, the one line a
user changes) in ``WORKSPACE`` up to ``MAX_STEPS``, with ``CheckpointingHook(interval=4,
keep_previous=1)`` and ``load="latest"``, one run after the other in the same process group (gloo,
created by the script as a trainloop user creates it; the model is wrapped in DDP). After each run
every rank writes what the test compares to ``DIR/<PACKAGE>.<WORKSPACE's name>.rank{R}.pt``: its step,
model parameters, EMA parameters, momentum buffers, learning rate and scheduler epoch.

trainloop's ``CheckpointingHook`` saves under DDP as it does alone: rank 0 writes ``trainer.state_dict()``
(the full model state, ``get_state_dict`` without DDP's ``module.`` prefix, and the whole optimizer
state, replicated on every rank) into ``<step>/``; every rank loads the same files. Each rank's
batches are its own (``batch(index, rank)``): DDP averages the ranks' gradients.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.nn.parallel import DistributedDataParallel

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Imported before the process group is created, as a user's script imports its trainer.
import trainloop

import trainfsm

PACKAGES = {"trainloop": trainloop, "trainfsm": trainfsm}


def batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


class Batches:
    """This rank's endless, re-iterable stream: each new iterator starts again at its first batch
    (trainloop saves no data position; both packages resume with a fresh iterator)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (batch(i % 5, self.rank) for i in itertools.count())


def user_trainer(package: ModuleType, workspace: Path, max_steps: int) -> Any:
    class Trainer(package.BaseTrainer):  # type: ignore[name-defined,misc]
        def build_data_loader(self) -> Batches:
            return Batches(dist.get_rank())

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            return DistributedDataParallel(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)))

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

        def build_lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.7)

        def build_hooks(self) -> list[Any]:
            # EMA first: trainloop loads in the CheckpointingHook's on_before_train, which must find it built.
            return [package.EMAHook(decay=0.9), package.CheckpointingHook(interval=4, keep_previous=1)]

        def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y), {}

    return Trainer(max_steps=max_steps, workspace=workspace, device="cpu")


def state(trainer: Any) -> dict[str, Any]:
    """What this rank holds after ``train()``, under the names a checkpoint gives them (trainloop's EMA
    averages the DDP module itself, trainfsm's the unwrapped model: the same tensors)."""
    ema = next(h for h in trainer.hooks if type(h).__name__ in ("EMAHook", "EmaHook")).ema_model
    flat: dict[str, Any] = {f"model.{k}": v.clone() for k, v in get_model_state_dict(trainer.model).items()}
    flat |= {f"ema.{k}": v.clone() for k, v in get_model_state_dict(ema).items()}
    for i, s in trainer.optimizer.state_dict()["state"].items():
        flat[f"momentum.{i}"] = s["momentum_buffer"].clone()
    flat["lr"] = torch.tensor(trainer.optimizer.param_groups[0]["lr"])
    flat["last_epoch"] = trainer.lr_scheduler.state_dict()["last_epoch"]
    flat["step"] = trainer.step
    return flat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run", action="append", required=True, help="PACKAGE:WORKSPACE:MAX_STEPS")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # as the user's script does (env://)
    rank = dist.get_rank()
    for run in args.run:
        name, workspace, max_steps = run.split(":")
        trainer = user_trainer(PACKAGES[name], Path(workspace), int(max_steps))
        trainer.train()
        torch.save(state(trainer), args.out / f"{name}.{Path(workspace).name}.rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
