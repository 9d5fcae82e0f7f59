"""Saves of a 200 MB state from GPU memory (the GPU tier, ``make test-gpu``): an asynchronous save
copies it into pinned host memory beside the next step's kernels and blocks the loop at most 1% of
what a synchronous save of the same state blocks it; both write the same bytes.

The small cases (exact resume from a checkpoint saved on CUDA, async against sync, a staged copy
that later steps do not reach) are tests/test_checkpointing.py's, run on both devices.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import trail_events
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.cuda

INPUT, WIDTH = 256, 5120  # 256 -> 5120 -> 5120 -> 5120: 53.7 M float32 parameters, 215 MB
BATCH = 2048  # ~0.7 TFLOP of float32 a step: 10-30 ms of GPU work, the next step the copy runs beside
STEPS, INTERVAL = 12, 3


class BigTrainer(BaseTrainer):
    """Three wide layers on CUDA, plain SGD (no optimizer state: the checkpoint is the 215 MB of
    parameters); small batches in pinned memory, moved without blocking as a real loader's are."""

    def __init__(self, hook: CheckpointingHook, **kwargs: Any) -> None:
        super().__init__(device="cuda", **kwargs)
        self.hook = hook

    def build_data_loader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        return [torch.randn(BATCH, INPUT, generator=g).pin_memory() for _ in range(4)] * (STEPS // 4 + 1)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(INPUT, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
        return nn.Sequential(*layers).to(self.device)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-6)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        return [self.hook, Spaced(self.hook)]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.model(input.to(self.device, non_blocking=True)).square().mean(), {}  # type: ignore[misc]


class Spaced(BaseHook):
    """Before a step that ends in a save, wait until the last asynchronous save's write is done, as
    in a run whose saves lie further apart than a write takes (a new save waits for the one in
    flight: that would be a wait for the disk, not for the copies). ``background_writes.began`` is
    None when no write is in flight."""

    def __init__(self, hook: CheckpointingHook) -> None:
        self.hook = hook

    def on_before_step(self, trainer: BaseTrainer) -> None:
        writes = self.hook.background_writes
        if writes is None or trainer.step % INTERVAL:
            return
        deadline = time.monotonic() + 60
        while writes.began is not None and time.monotonic() < deadline:
            time.sleep(0.005)


def saved(workspace: Path) -> list[dict[str, Any]]:
    return [e for e in trail_events(workspace) if e["event"] == "checkpoint_saved"]


def test_an_async_save_of_200_mb_from_gpu_memory_blocks_the_loop_under_1_percent_of_a_sync_save(
    tmp_path: Path,
) -> None:
    sync_hook = CheckpointingHook(interval=INTERVAL, keep_previous=1)
    sync = BigTrainer(sync_hook, max_steps=STEPS, workspace=tmp_path / "sync")
    sync.train()
    async_hook = CheckpointingHook(interval=INTERVAL, keep_previous=1, async_save=True)
    asynchronous = BigTrainer(async_hook, max_steps=STEPS, workspace=tmp_path / "async")
    asynchronous.train()

    # The copies went to page-locked memory, kept for the next save (the hook's own staging tensors).
    spare = async_hook._background.spare
    assert sum(t.numel() * t.element_size() for t in spare) >= 200e6
    assert spare and all(t.device.type == "cpu" and t.is_pinned() for t in spare)

    sync_saves, async_saves = saved(tmp_path / "sync"), saved(tmp_path / "async")
    assert [e["saved_step"] for e in sync_saves] == [e["saved_step"] for e in async_saves] == [3, 6, 9, 12]
    assert all(e["bytes"] >= 200e6 for e in sync_saves)
    assert not any(e["asynchronous"] for e in sync_saves) and all(e["asynchronous"] for e in async_saves)
    # The saves the loop steps on from (the last one's wait is EXIT's); a synchronous save blocks
    # the loop for all of its time.
    sync_seconds = statistics.mean(e["seconds"] for e in sync_saves[:-1])
    blocked = [e["blocked_seconds"] for e in async_saves[:-1]]
    assert statistics.mean(blocked) <= 0.01 * sync_seconds, (
        f"the loop was blocked {[round(b * 1e3, 2) for b in blocked]} ms by asynchronous saves, "
        f"a synchronous one takes {sync_seconds * 1e3:.1f} ms"
    )

    # Both wrote the state of the same steps, bit for bit, and the runs trained alike.
    for step in (INTERVAL * 3, STEPS):
        a = CheckpointStore.load(tmp_path / "sync" / "checkpoints" / str(step))["model"]["model"]
        b = CheckpointStore.load(tmp_path / "async" / "checkpoints" / str(step))["model"]["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    final = {k: v.cpu() for k, v in asynchronous.unwrapped_model.state_dict().items()}
    assert all(torch.equal(final[k], b[k]) for k in final)
    for x, y in zip(sync.model.parameters(), asynchronous.model.parameters(), strict=True):  # type: ignore[union-attr]
        assert torch.equal(x, y)
