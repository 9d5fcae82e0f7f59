"""Host syncs per routine step on CUDA, counted by torch itself (the GPU tier, ``make test-gpu``).

``torch.cuda.set_sync_debug_mode("warn")`` makes every operation that waits for the device on the
host (a ``.item()``, a ``bool()`` of a CUDA tensor, a blocking copy) warn "called a synchronizing
CUDA operation", from the Python line that called it. The documented count (the design's promise,
docs/guides/performance.md): one sync per optimizer step, the finite guard's read of its flag;
none on a micro-batch that only accumulates. With fp16 too: ``Stepper.apply`` steps the optimizer
on the guard's answer and calls ``scaler.update()`` rather than ``GradScaler.step``, whose
``_maybe_opt_step`` would read the same flag again. A ``ProgressHook`` adds its interval's
one copy to the host, at its interval only; a ``CheckpointingHook`` between its saves and
``CudaMaxMemoryHook`` (allocator bookkeeping) add none.

The counts are per forward call: the syncs from one training forward to the next, so a micro-batch
that only accumulates must show 0 and a step's last micro-batch the step's count (its backward, the
guard, the optimizer step, the hooks, the next draw). The first steps (the first optimizer step
makes its state; fp16's scale settles) are left out. The batches wait in pinned host memory and go
to the GPU without blocking, as a ``DataLoader(pin_memory=True)``'s do; ``forward`` reads nothing
on the host.

The CPU tests of the same promise, which name the line of each read: tests/test_host_syncs.py.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import TinyTrainer, make_batches, read_events
from trainfsm import BaseHook, CheckpointingHook, CudaMaxMemoryHook, ProgressHook

pytestmark = pytest.mark.cuda

SYNC = "called a synchronizing CUDA operation"
#: The counted steps: 6-13. fp16's scaler starts at 2**16 and skips its first steps until the scale
#: fits (on CPU the first skip came at step 4); a skip reads the scale for its ``non_finite`` event,
#: one more sync, at that step only (counted from the trail's events, wherever it falls).
WARM_UP, STEPS = 5, 14


class CountingTrainer(TinyTrainer):
    """TinyTrainer on CUDA whose ``forward`` reads nothing on the host and notes, at each training
    forward call, how many sync warnings ``caught`` holds so far."""

    def __init__(self, caught: list[warnings.WarningMessage], **kwargs: Any) -> None:
        batches = [
            {"i": b["i"], "x": b["x"].pin_memory(), "y": b["y"].pin_memory()} for b in make_batches(STEPS * 4 + 8)
        ]
        super().__init__(batches=batches, device="cuda", **kwargs)
        self.caught = caught
        self.marks: list[tuple[int, int]] = []  # (step, syncs so far) at each forward

    def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
        assert self.model is not None
        self.marks.append((self.step, sum(SYNC in str(w.message) for w in self.caught)))
        x = input["x"].to(self.device, non_blocking=True)
        y = input["y"].to(self.device, non_blocking=True)
        out = self.model(x).float()
        return nn.functional.mse_loss(out, y), {"error": (out - y).abs().mean().detach()}


def count(tmp_path: Path, **kwargs: Any) -> tuple[list[tuple[int, int]], list[str], set[int]]:
    """(step, syncs from this forward to the next) for each forward call of the counted steps;
    where each sync of the run was called from; the steps the fp16 scaler skipped."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = CountingTrainer(caught, max_steps=STEPS, workspace=tmp_path, **kwargs)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    deltas = [(step, after - before) for (step, before), (_, after) in itertools.pairwise(trainer.marks)]
    where = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC in str(w.message)]
    skipped = {e["step"] for e in read_events(tmp_path) if e["event"] == "non_finite" and e["what"] == "scaler_skip"}
    return [(step, n) for step, n in deltas if WARM_UP < step < STEPS], where, skipped


def expected(per_step: Callable[[int], int], accumulation: int) -> list[tuple[int, int]]:
    """0 for each micro-batch that only accumulates, ``per_step(step)`` for each step's last; the
    last step has no next forward call, so it is not counted."""
    return [
        (step, per_step(step) if micro == accumulation - 1 else 0)
        for step in range(WARM_UP + 1, STEPS)
        for micro in range(accumulation)
    ]


#: The options of each case, and the syncs of a routine step with them.
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "plain": ({}, 1),
    "accumulate_4": ({"gradient_accumulation_steps": 4}, 1),
    "grad_clip": ({"grad_clip": 1.0, "gradient_accumulation_steps": 2}, 1),
    "bf16": ({"mixed_precision": "bf16", "gradient_accumulation_steps": 2}, 1),
    # The guard's read of the scaler's flags only (not GradScaler.step's second read).
    "fp16": ({"mixed_precision": "fp16", "gradient_accumulation_steps": 2}, 1),
    "fp16_grad_clip": ({"mixed_precision": "fp16", "grad_clip": 1.0}, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_routine_step_on_cuda_syncs_once_and_an_accumulating_micro_batch_never(tmp_path: Path, case: str) -> None:
    options, routine = CASES[case]
    counted, where, skipped = count(tmp_path, **options)
    want = expected(lambda step: routine + (step in skipped), options.get("gradient_accumulation_steps", 1))
    assert counted == want, f"syncs per forward call (step, syncs): {counted}; the run's syncs came from {where}"
    if "mixed_precision" not in options:
        assert not skipped


def test_common_hooks_add_only_the_progress_lines_copy_at_its_interval(tmp_path: Path) -> None:
    hooks: list[BaseHook] = [
        ProgressHook(interval=4),
        CheckpointingHook(interval=1000),  # between saves (it saves the last step: not counted)
        CudaMaxMemoryHook(),
    ]
    counted, where, _ = count(tmp_path, hooks=hooks, gradient_accumulation_steps=2)
    want = expected(lambda step: 1 + (step % 4 == 0), 2)
    assert counted == want, f"syncs per forward call (step, syncs): {counted}; the run's syncs came from {where}"
