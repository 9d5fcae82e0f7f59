"""A trainer whose forward raises the real ``torch.OutOfMemoryError`` above a batch size: the tests'
fault injection for out-of-memory retries (``trainfsm.oom``), as SIGKILL is for kills.

Batches are ``{"x": (rows, 8), "y": (rows, 1)}`` from a seeded generator; ``quartered`` gives the same
samples as micro-batches of a quarter of the rows each, in order: what a run that split twice trains.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainfsm import BaseTrainer


def batches(n: int, rows: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(rows, 8, generator=generator)
        out.append({"x": x, "y": x.sum(1, keepdim=True) * 0.1 + 0.05 * torch.randn(rows, 1, generator=generator)})
    return out


def quartered(data: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    out = []
    for batch in data:
        rows = batch["x"].shape[0]
        for i in range(4):
            out.append({key: value[i * rows // 4 : (i + 1) * rows // 4] for key, value in batch.items()})
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class FitsUpTo(BaseTrainer):
    """``limit``: the most rows a forward takes before it runs out of memory (None: any);
    ``in_backward``: run out in backward instead (a hook on the loss's gradient);
    ``wrap``: the model's wrapper (DDP), applied in ``build_model``; ``hooks``: ``build_hooks``'s."""

    def __init__(
        self,
        data: Any,
        limit: int | None = None,
        in_backward: bool = False,
        wrap: Any = None,
        hooks: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        self.data, self.limit, self.in_backward, self.wrap = data, limit, in_backward, wrap
        self.hook_list = list(hooks or [])
        self.rows_seen: list[int] = []  # rows of every forward that ran to its end

    def build_data_loader(self) -> Any:
        return self.data

    def build_hooks(self) -> list[Any]:
        return self.hook_list

    def build_model(self) -> nn.Module:
        built = model()
        return self.wrap(built) if self.wrap is not None else built

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.05)  # type: ignore[union-attr]

    def forward(self, batch: Any) -> Any:
        rows = batch["x"].shape[0]
        too_big = self.limit is not None and rows > self.limit
        if too_big and not self.in_backward:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {rows} rows (planted above {self.limit})"
            )
        loss = nn.functional.mse_loss(self.model(batch["x"]), batch["y"])  # type: ignore[misc]
        if too_big:
            loss.register_hook(lambda grad: _out_of_memory(rows, self.limit))
        self.rows_seen.append(rows)
        return loss, {"rows": float(rows)}


def _out_of_memory(rows: int, limit: int | None) -> None:
    raise torch.OutOfMemoryError(f"CUDA out of memory in backward: {rows} rows (planted above {limit})")
