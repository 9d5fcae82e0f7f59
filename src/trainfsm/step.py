"""One micro-batch and one optimizer step: autocast, loss scaling, ``no_sync``, the finite check.

The trainer's ACCUMULATE state calls ``Stepper.micro`` once per micro-batch and, on a step's last
micro-batch, ``check_and_clip`` and ``apply``. Everything that does not change between steps (the
autocast context, the parameter lists, which optional pieces exist) is resolved in ``__init__``, so
a step does no lookups and no host syncs beyond the one finite check. (With several ranks and exit
signals, the step-end signal agreement is a host collective on gloo (``trainfsm.collectives``): a
wait for the other ranks' hosts, never for the device.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainfsm import activity
from trainfsm.collectives import LossNoneAgreement
from trainfsm.finite import FiniteCheck
from trainfsm.options import MIXED_PRECISIONS
from trainfsm.utils import is_distributed_wrapper

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

#: ``mixed_precision`` (``trainfsm.options.MIXED_PRECISIONS``, or None) -> the autocast dtype.
MIXED_PRECISION_DTYPES: dict[str | None, torch.dtype | None] = {
    None: None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
assert set(MIXED_PRECISION_DTYPES) == {None, *MIXED_PRECISIONS}


class Stepper:
    """The tensor work of a step, configured once from the trainer's built components."""

    @classmethod
    def for_trainer(cls, trainer: BaseTrainer, agreement: LossNoneAgreement | None) -> Stepper:
        """The stepper of a built trainer: its components and settings. Accumulation skips the
        gradient all-reduce on all but the last micro-batch (``no_sync``) when the model offers
        it and ``no_sync_accumulate`` allows it."""
        model, accumulation = trainer.model, trainer.gradient_accumulation_steps
        # max_oom_retries: a split micro-batch's pieces accumulate too, so they need no_sync even
        # at accumulation 1 (a routine step of one whole micro-batch is always ``last``: unchanged).
        accumulates = accumulation > 1 or trainer.max_oom_retries > 0
        no_sync = getattr(model, "no_sync", None) if trainer.no_sync_accumulate and accumulates else None
        activity.name(cls._forward_backward, forward_or_backward(model is not None and is_distributed_wrapper(model)))
        return cls(
            model=model,  # type: ignore[arg-type]
            optimizer=trainer.optimizer,  # type: ignore[arg-type]
            scheduler=trainer.lr_scheduler,
            scaler=trainer.grad_scaler,  # type: ignore[arg-type]
            device=trainer.device,
            mixed_precision=trainer.mixed_precision,
            accumulation=accumulation,
            grad_clip=trainer.grad_clip,
            no_sync=no_sync,
            agreement=agreement,
        )

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
        agreement: LossNoneAgreement | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.scaler_enabled = scaler.is_enabled()
        self.grad_clip = grad_clip
        self.accumulation = accumulation
        self.inv_accumulation = 1.0 / accumulation
        self.no_sync = no_sync
        self.agreement = agreement
        dtype = MIXED_PRECISION_DTYPES[mixed_precision]
        # One autocast object, re-entered every micro-batch: building one costs a few µs.
        self.autocast = torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else None
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
        self, forward: Callable[[Any], Any], batch: Any, last: bool, weight: float | None = None
    ) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward of one micro-batch; returns (unscaled loss, records) detached.

        The loss is divided by the accumulation count so the accumulated gradient is the mean
        over the step's micro-batches (``weight``: its factor instead, for a piece of a split
        micro-batch, ``trainfsm.oom``). ``no_sync`` wraps forward and backward of every micro-batch
        but the last, so DDP all-reduces once per step.

        With ``loss_none_agreement`` (an ``agreement``), the ranks agree between forward and backward: the
        loss is None on every rank when it was None on any, so nobody runs backward and DDP's
        gradient all-reduces stay paired (one small host collective, see ``trainfsm.collectives``).
        """
        if self.no_sync is not None and not last:
            with self.no_sync():
                return self._forward_backward(forward, batch, weight)
        return self._forward_backward(forward, batch, weight)

    def _forward_backward(
        self, forward: Callable[[Any], Any], batch: Any, weight: float | None = None
    ) -> tuple[torch.Tensor | None, Any]:
        if self.autocast is not None:
            with self.autocast:  # backward runs outside autocast, as PyTorch recommends
                out = forward(batch)
        else:
            out = forward(batch)
        loss, records = _check_forward_result(out)
        # With an agreement, a wait for every rank (a host collective, not a device sync): no rank
        # may start the backward of a micro-batch that another rank skips, or DDP's all-reduces
        # pair up wrongly. It says skip whenever this rank's loss is None.
        skip = loss is None
        if self.agreement is not None:
            skip = self.agreement.skip(skip)  # a host collective: every rank waits here
        if skip or loss is None:
            return None, records
        if weight is not None:
            scaled = loss * weight
        else:
            scaled = loss * self.inv_accumulation if self.accumulation != 1 else loss
        if self.scaler_enabled:
            scaled = self.scaler.scale(scaled)
        scaled.backward()  # type: ignore[no-untyped-call]
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
        if self.scaler_enabled and not self.finite.sharded:
            # unscale_ already ran the fused finite check over every gradient: read its flags
            # rather than reading the gradients a second time.
            found = self.scaler._found_inf_per_device(self.optimizer).values()
            return not any(bool(flag) for flag in found), None  # host sync, see above
        return not self.finite(), None

    def apply(self, finite: bool) -> bool:
        """Optimizer step, scaler update, zero grads, scheduler step; True if the step applied.

        With an fp16 scaler a non-finite step is skipped and the scale backs off, as PyTorch
        intends. ``check_and_clip`` unscaled the gradients and read the scaler's inf flags already
        (``finite``), so the optimizer steps on that answer: ``GradScaler.step`` would read the same
        flags again (``_maybe_opt_step``'s ``item``), a second host sync per step for nothing.
        ``update`` takes the flags from ``unscale_`` on the device. The scheduler advances only after
        an applied step, so a skipped or retried step never advances it.
        """
        if self.scaler_enabled:
            if finite:
                self.optimizer.step()
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
    """Shapes and types only (no host sync): a wrong return fails here, named, not deep in torch."""
    if type(out) is tuple and len(out) == 2:
        loss, records = out
        if type(records) is not dict and not isinstance(records, Mapping):  # dict: no ABC check
            raise TypeError(
                f"forward() must return (loss, records) with records a dict of numbers (e.g. "
                f"{{'accuracy': acc}}, or {{}}); got records of type {type(records).__name__}."
            )
        if loss is None:
            return loss, records
        if isinstance(loss, torch.Tensor):
            if loss.numel() == 1:
                return loss, records
            raise ValueError(
                f"forward() must return a scalar loss (one element) to run backward on; got a tensor of "
                f"shape {tuple(loss.shape)}. Reduce it first, e.g. loss.mean() or loss.sum()."
            )
        raise TypeError(
            f"forward() must return (loss, records) with loss a scalar torch.Tensor or None; "
            f"got loss of type {type(loss).__name__}."
        )
    raise TypeError(
        f"forward() must return a 2-tuple (loss, records); got {type(out).__name__}"
        f"{f' of length {len(out)}' if isinstance(out, tuple) else ''}. "
        f"Return e.g. `return loss, {{'accuracy': acc}}` (records may be an empty dict)."
    )


def retries_used_up(step: int, retries: int, limit: int) -> RuntimeError:
    """The error RETRY raises when a step's gradients stay non-finite past ``limit`` retries."""
    if limit == 0:
        return RuntimeError(
            f"Step {step}: gradients are non-finite and retries are disabled "
            f"(max_non_finite_grad_retries={limit}); set it to a positive integer to re-run "
            f"the step on fresh micro-batches, or enable mixed_precision='fp16' with a grad scaler."
        )
    return RuntimeError(
        f"Step {step}: gradients were non-finite on {retries + 1} attempts "
        f"({retries} retries, max_non_finite_grad_retries={limit}); stopping instead of "
        f"stepping non-finite values into the weights. Lower the learning rate, set grad_clip, "
        f"or check the data."
    )


def forward_or_backward(distributed: bool) -> activity.Describe:
    """``_forward_backward``'s frame: in backward when the frame it called is ``Tensor.backward`` (or
    it called none: C code, almost always backward), where DDP's and FSDP's gradient collectives
    wait for every rank; else in the user's ``forward``."""

    def describe(frame: Any, inner: Any) -> tuple[str, bool]:
        if inner is not None and activity.qualname(inner.f_code) != "Tensor.backward":
            return "forward", False
        if distributed:
            return "backward, whose gradient all-reduce (DDP) or reduce-scatter (FSDP) waits for every rank", True
        return "backward", False

    return describe


activity.name(Stepper.check_and_clip, "the gradients' finite check and clipping")
activity.name(Stepper.apply, "the optimizer step")
