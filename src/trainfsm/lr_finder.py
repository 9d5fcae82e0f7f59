"""The learning-rate range test: sweep the rate up exponentially, watch the loss, pick a rate.

It trains for real (forward, backward, optimizer step) on ``num_steps`` batches while the rate grows
from ``start_lr`` to ``end_lr``, keeps an exponentially smoothed loss, stops once the smoothed loss
exceeds ``divergence`` times the best seen, and suggests the rate where the smoothed loss fell
fastest (the steepest negative slope against log rate). Model and optimizer are restored to their
state before the test, so the run that follows starts from where it was.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class LRFindResult:
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # smoothed
    suggestion: float | None = None
    diverged: bool = False

    def plot(self, path: str | Path) -> Path:
        """Loss against learning rate (log scale) to a PNG; needs matplotlib (the ``plot`` extra)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("LRFindResult.plot needs matplotlib: pip install 'trainfsm[plot]'") from None
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.plot(self.lrs, self.losses)
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("smoothed loss")
        if self.suggestion is not None:
            axes.axvline(self.suggestion, color="red", linestyle="--", label=f"suggestion {self.suggestion:.2e}")
            axes.legend()
        path = Path(path)
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        return path


def lr_find(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    compute_loss: Callable[[Any], torch.Tensor],
    *,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    smoothing: float = 0.05,
    divergence: float = 4.0,
    plot_path: str | Path | None = None,
) -> LRFindResult:
    """Run the range test; ``compute_loss(batch)`` returns the loss of ``model`` on ``batch``.

    ``batches`` is cycled if it has fewer than ``num_steps`` batches.
    """
    if not 0 < start_lr < end_lr:
        raise ValueError(f"need 0 < start_lr < end_lr; got start_lr={start_lr!r}, end_lr={end_lr!r}.")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(f"num_steps must be an int >= 2; got {num_steps!r}.")
    if not 0 < smoothing < 1:
        raise ValueError(f"smoothing must be in (0, 1); got {smoothing!r}.")
    if not divergence > 1:
        raise ValueError(f"divergence must be > 1; got {divergence!r}.")
    # Copies, not references: the test mutates the live tensors in place.
    model_state = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    was_training = model.training
    result = LRFindResult()
    ratio = (end_lr / start_lr) ** (1 / (num_steps - 1))
    try:
        model.train()
        smoothed, best = 0.0, math.inf
        iterator = _cycle(batches)
        for index in range(num_steps):
            lr = start_lr * ratio**index
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss = compute_loss(next(iterator))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            value = float(loss.detach())
            smoothed = smoothing * value + (1 - smoothing) * smoothed  # from 0, hence the debiasing
            debiased = smoothed / (1 - (1 - smoothing) ** (index + 1))
            result.lrs.append(lr)
            result.losses.append(debiased)
            best = min(best, debiased)
            if not math.isfinite(debiased) or debiased > divergence * best:
                result.diverged = True
                break
    finally:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        optimizer.zero_grad(set_to_none=True)
        model.train(was_training)
    result.suggestion = _steepest(result.lrs, result.losses)
    if plot_path is not None:
        result.plot(plot_path)
    return result


def _steepest(lrs: list[float], losses: list[float]) -> float | None:
    """The rate where d(loss)/d(log lr) is most negative (ignoring the final, diverging points)."""
    points = [(math.log(lr), loss) for lr, loss in zip(lrs, losses, strict=True) if math.isfinite(loss)]
    if len(points) < 3:
        return None
    slopes = [
        (points[i + 1][1] - points[i - 1][1]) / (points[i + 1][0] - points[i - 1][0]) for i in range(1, len(points) - 1)
    ]
    index = min(range(len(slopes)), key=slopes.__getitem__)
    return lrs[index + 1]


def _cycle(batches: Iterable[Any]) -> Any:
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            raise ValueError("lr_find: batches is empty")
