"""One micro-batch and one optimizer step: autocast, loss scaling, ``no_sync``, the finite check.

The trainer's ACCUMULATE state calls ``Stepper.micro`` once per micro-batch and, on a step's last
micro-batch, ``grads_finite`` and ``apply``. Everything that does not change between steps (the
autocast context, the parameter lists, which optional pieces exist) is resolved in ``__init__``, so
a step does no lookups and no host syncs beyond the one finite check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

MIXED_PRECISION_DTYPES: dict[str | None, torch.dtype | None] = {
    None: None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 gradients), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class FiniteCheck:
    """Whether all gradients are finite, in one fused pass per (device, dtype).

    It reuses the fused kernel ``GradScaler`` runs for fp16 (``_amp_foreach_non_finite_check_
    and_unscale_``) with an inverse scale of exactly 1.0, which leaves gradients bit-identical. An
    infinity-norm over the gradients finds the same thing but costs ~20x more on CPU.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for param in params:
            local = _local(param)
            groups.setdefault((local.device, local.dtype), []).append(param)
        self._groups = [
            (group, torch.zeros(1, device=device), torch.ones(1, device=device))
            for (device, _), group in groups.items()
        ]
        self._sharded = any(_local(param) is not param for param in params)

    def found_non_finite(self) -> torch.Tensor | None:
        """A tensor > 0 when some gradient is non-finite (no host sync); None without gradients."""
        total: torch.Tensor | None = None
        for params, found, one in self._groups:
            if self._sharded:
                grads = [_local(p.grad) for p in params if p.grad is not None]
            else:
                grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            found.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
            total = found if total is None else total + found.to(total.device)
        return total


class Stepper:
    """The tensor work of a step, configured once from the trainer's built components."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: torch.amp.GradScaler,
        device: torch.device,
        mixed_precision: str | None,
        accumulation: int,
        grad_clip: float | None,
        no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.scaler_enabled = scaler.is_enabled()
        self.grad_clip = grad_clip
        self.accumulation = accumulation
        self.inv_accumulation = 1.0 / accumulation
        self.no_sync = no_sync
        dtype = MIXED_PRECISION_DTYPES[mixed_precision]
        # One autocast object, re-entered every micro-batch: building one costs a few µs.
        self.autocast = (
            torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else None
        )
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in seen:
                    seen.add(id(param))
                    self.params.append(param)
        self.finite = FiniteCheck(self.params)
        del model  # the step only needs the optimizer's parameters; forward is the trainer's

    def micro(
        self, forward: Callable[[Any], Any], batch: Any, last: bool
    ) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward of one micro-batch; returns (unscaled loss, records) detached.

        The loss is divided by the accumulation count so the accumulated gradient is the mean
        over the step's micro-batches. ``no_sync`` wraps forward and backward of every micro-batch
        but the last, so DDP all-reduces once per step.
        """
        with self.no_sync() if self.no_sync is not None and not last else contextlib.nullcontext():
            if self.autocast is not None:
                with self.autocast:
                    out = forward(batch)
            else:
                out = forward(batch)
            loss, records = _check_forward_result(out)
            if loss is None:
                return None, records
            scaled = loss * self.inv_accumulation if self.accumulation != 1 else loss
            if self.scaler_enabled:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return loss.detach(), records

    def check_and_clip(self) -> tuple[bool, torch.Tensor | None]:
        """Unscale (fp16), clip, and decide whether every gradient is finite.

        With ``grad_clip`` the total norm that clipping computes anyway is the check (a
        non-finite gradient makes it non-finite); without it, one fused pass over the gradients.
        The ``bool()`` is the step's one host sync: stepping or retrying is a decision the host
        must make before it issues the next kernel. Returns (finite, total norm or None).
        """
        if self.scaler_enabled:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
            return bool(torch.isfinite(norm)), norm  # host sync, see above
        found = self.finite.found_non_finite()
        return found is None or not bool(found), None  # host sync, see above

    def apply(self, finite: bool) -> bool:
        """Optimizer step, scaler update, zero grads, scheduler step; True if the step applied.

        With an fp16 scaler a non-finite step is skipped by ``scaler.step`` and the scale backs
        off, as PyTorch intends. The scheduler advances only after an applied step, so a skipped
        or retried step never advances it.
        """
        if self.scaler_enabled:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if finite and self.scheduler is not None:
            self.scheduler.step()
        return finite

    def discard(self) -> None:
        """Drop the gradients of a step that will be retried."""
        self.optimizer.zero_grad(set_to_none=True)


def _check_forward_result(out: Any) -> tuple[torch.Tensor | None, Any]:
    if type(out) is tuple and len(out) == 2:
        loss, records = out
        if loss is None or isinstance(loss, torch.Tensor):
            return loss, records
        raise TypeError(
            f"forward() must return (loss, records) with loss a scalar torch.Tensor or None; "
            f"got loss of type {type(loss).__name__}."
        )
    raise TypeError(
        f"forward() must return a 2-tuple (loss, records); got {type(out).__name__}"
        f"{f' of length {len(out)}' if isinstance(out, tuple) else ''}. "
        f"Return e.g. `return loss, {{'accuracy': acc}}` (records may be an empty dict)."
    )


def close_iterator(iterator: Iterator[Any] | None) -> None:
    """Close a data iterator: generators run their ``finally``; DataLoader workers shut down."""
    if iterator is None:
        return
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
        return
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
