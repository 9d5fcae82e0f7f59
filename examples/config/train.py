"""The documented config-driven setup with ``cfgx`` and ``specbuild``, on CPU.

    pip install cfgx specbuild
    python examples/config/train.py                       # configs/train.py as it is
    python examples/config/train.py --steps 50 --workspace runs/config_short
    python examples/config/train.py --set optimizer.lr=1e-3 --set model.hidden_dim=128

``cfgx.load`` runs ``configs/train.py`` and returns its ``config`` dict (with ``--set path=value``
overrides applied); ``specbuild.build`` turns a dict with a ``type`` key into the object it names,
here the trainer, which builds its data loader, model and optimizer from the nested dicts in its
``build_*`` methods (``recursive=False``: the trainer builds those itself, when the machine is in
BUILD). Unlike the reference, no process group is set up: one process on CPU needs none.

The run writes checkpoints to ``WORKSPACE/checkpoints`` and its audit trail to
``WORKSPACE/logs/events.rank0.jsonl``; run it again to resume from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
from cfgx import load
from specbuild import build, register
from torch import nn
from torch.utils.data import Dataset

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook, ProgressHook

HERE = Path(__file__).resolve().parent


@register()
class MyTrainer(BaseTrainer):
    def __init__(self, data: dict[str, Any], model: dict[str, Any], optimizer: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.data_cfg = data
        self.model_cfg = model
        self.optimizer_cfg = optimizer

    def build_data_loader(self) -> Any:
        return build(self.data_cfg)

    def build_model(self) -> nn.Module:
        model: nn.Module = build(self.model_cfg)
        return model.to(self.device)

    def build_optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None
        optimizer: torch.optim.Optimizer = build(self.optimizer_cfg | {"params": self.model.parameters()})
        return optimizer

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = input
        x, y = x.to(self.device), y.to(self.device)
        logits = self.model(x)  # type: ignore[misc]
        loss = nn.functional.cross_entropy(logits, y)
        # A tensor, not .item(): no host sync per step; ProgressHook reads it once per interval.
        return loss, {"accuracy": (logits.detach().argmax(1) == y).float().mean()}

    def build_hooks(self) -> list[BaseHook]:
        return [
            ProgressHook(interval=50, with_records=True),
            CheckpointingHook(interval=100, keep_previous=1),  # under workspace/checkpoints
        ]


@register()
class ToyDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """In memory: inputs labelled by a fixed random linear "teacher" (learnable, nothing downloaded)."""

    def __init__(self, size: int = 1024, features: int = 32, classes: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=generator)
        teacher = torch.randn(features, classes, generator=generator)
        self.y = (self.x @ teacher).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


@register()
class MyModel(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=HERE / "configs" / "train.py", help="the config file")
    parser.add_argument("--steps", type=int, help="override max_steps")
    parser.add_argument("--workspace", type=Path, help="override workspace")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="a cfgx override")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"max_steps={args.steps}")
    cfg = load(args.config, overrides=overrides)
    if args.workspace is not None:  # a path, set here rather than quoted into an override
        cfg["workspace"] = str(args.workspace)

    torch.manual_seed(0)
    trainer = build(cfg | {"device": "cpu"}, recursive=False)
    trainer.train()
    info = trainer.step_info
    workspace = Path(cfg["workspace"])
    print(f"exit reason: {trainer.exit_reason}")
    if "loss" in info:
        print(
            # step_info keeps each micro-batch's loss and records (lists), as trainloop does
            f"final step {trainer.step}: loss {float(info['loss'][-1]):.4f}, "
            f"batch accuracy {float(info['records'][-1]['accuracy']):.3f}"
        )
    print(f"checkpoints: {workspace / 'checkpoints'}")
    print(f"audit trail: {workspace / 'logs' / f'events.rank{trainer.rank}.jsonl'}")


if __name__ == "__main__":
    main()
