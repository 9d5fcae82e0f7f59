"""Learning-rate schedules by name, with warm-up: the four every config file asks for.

``create_scheduler`` returns a ``LambdaLR``; its state (``last_epoch``, base rates) is what a
checkpoint saves, and ``build_lr_scheduler`` rebuilds the same function on resume, so a resumed
run continues the schedule exactly. The trainer steps it once per applied optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import torch
from torch.optim.lr_scheduler import LambdaLR

from trainfsm.options import int_at_least

SCHEDULES: Final = ("constant", "constant_with_warmup", "linear", "cosine")


def resolve_warmup_steps(warmup_steps: int | None, warmup_ratio: float | None, total_steps: int) -> int:
    """Warm-up length from either a step count or a fraction of ``total_steps`` (not both)."""
    total = int_at_least("total_steps", total_steps, 1)
    if warmup_steps is not None and warmup_ratio is not None:
        raise ValueError(
            f"give warmup_steps or warmup_ratio, not both (got warmup_steps={warmup_steps!r}, "
            f"warmup_ratio={warmup_ratio!r})."
        )
    if warmup_ratio is not None:
        if isinstance(warmup_ratio, bool) or not isinstance(warmup_ratio, (int, float)) or not 0 <= warmup_ratio <= 1:
            raise ValueError(f"warmup_ratio must be a number in [0, 1]; got {warmup_ratio!r}.")
        return math.ceil(warmup_ratio * total)
    if warmup_steps is None:
        return 0
    steps = int_at_least("warmup_steps", warmup_steps, 0)
    if steps > total:
        raise ValueError(f"warmup_steps ({steps}) must not exceed total_steps ({total}).")
    return steps


def schedule_factor(scheduler_type: str, total_steps: int, warmup_steps: int = 0) -> Callable[[int], float]:
    """The multiplier of the base learning rate after ``step`` scheduler steps."""
    if scheduler_type not in SCHEDULES:
        raise ValueError(f"scheduler_type must be one of {', '.join(SCHEDULES)}; got {scheduler_type!r}.")
    total = int_at_least("total_steps", total_steps, 1)
    warmup = resolve_warmup_steps(warmup_steps, None, total)
    if scheduler_type == "constant":
        return lambda step: 1.0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)  # never 0: the first step already learns something
        if scheduler_type == "constant_with_warmup":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if scheduler_type == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def create_scheduler(
    optimizer: torch.optim.Optimizer, scheduler_type: str, total_steps: int, warmup_steps: int = 0
) -> LambdaLR:
    """``"cosine"``, ``"linear"``, ``"constant"`` or ``"constant_with_warmup"`` over ``total_steps``.

    Warm-up rises linearly to the base rate over ``warmup_steps``; "linear" and "cosine" then decay
    to 0 at ``total_steps``.
    """
    return LambdaLR(optimizer, schedule_factor(scheduler_type, total_steps, warmup_steps))
