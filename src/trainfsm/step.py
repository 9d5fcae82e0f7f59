"""One micro-batch and one optimizer step: autocast, loss scaling, ``no_sync``, the finite check.

The trainer's ACCUMULATE state calls ``Stepper.micro`` once per micro-batch and, on a step's last
micro-batch, ``grads_finite`` and ``apply``. Everything that does not change between steps (the
autocast context, the parameter lists, which optional pieces exist) is resolved in ``__init__``, so
a step does no lookups and no host syncs beyond the one finite check.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from functools import partial
from operator import attrgetter, is_not
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from trainfsm import collectives
from trainfsm.collectives import LossNoneAgreement
from trainfsm.options import MIXED_PRECISIONS
from trainfsm.utils import local_part

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

#: ``mixed_precision`` (``trainfsm.options.MIXED_PRECISIONS``, or None) -> the autocast dtype.
MIXED_PRECISION_DTYPES: dict[str | None, torch.dtype | None] = {
    None: None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
assert set(MIXED_PRECISION_DTYPES) == {None, *MIXED_PRECISIONS}


# CPU gradients with at least this many elements are summed one by one; smaller ones share one
# fused pass. Measured here (FiniteCheck's docstring): one sum and its host read cost ~4.5 µs of
# dispatch per tensor, the fused pass reads and writes, ~0.1 ns per element more than a sum; the
# two meet near 45,000 elements.
CPU_SUM_MIN_ELEMENTS = 32768


class FiniteCheck:
    """Whether every gradient is finite: one read of each gradient, one host read per pass.

    The fused kernel ``GradScaler`` uses for fp16 (``_amp_foreach_non_finite_check_and_unscale_``),
    called with an inverse scale of exactly 1.0, checks a whole list of gradients in one dispatch
    and leaves them bit-identical (x * 1.0 == x); its flag is read once. It writes every element,
    though, where a sum only reads, so on CPU it serves the many small tensors (biases, norms)
    while each large one is summed (NaN and infinities propagate into a sum) and its sum read.
    Measured in situ, the small benchmark model (784-128-10: one 100k-element weight, three small
    tensors) costs ~22 µs a step as four sums, ~28-40 µs as one fused pass, ~15-24 µs split this
    way; a model of 784x1 and 1x2 layers ~19 µs as sums, ~6 µs fused; a 2-norm costs ~40 µs and
    an infinity-norm (the `trainloop` package's check) ~330 µs. A gradient whose elements sum
    past the float range (~3.4e38) counts as non-finite too; stepping it would be just as wrong.
    Low-precision CPU gradients are summed in float32 for that reason.

    On accelerators per-tensor host reads would each be a sync, so every gradient there goes
    through the fused kernel and its flag is the one read.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.sharded = any(local_part(param) is not param for param in params)
        if self.sharded:  # the flag lives where the collective runs: CUDA for nccl, CPU for gloo
            import torch.distributed as dist

            device = params[0].device if dist.get_backend() == "nccl" else torch.device("cpu")
            self._flag = torch.zeros(1, device=device)
        fused_cpu = _fused_check_runs_on_cpu()
        # Summed one by one: (parameter, dtype to sum in or None). Fused: (parameters, flag, 1.0).
        self._summed: list[tuple[nn.Parameter, torch.dtype | None]] = []
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for param in params:
            local = local_part(param)
            low_precision = local.dtype in (torch.float16, torch.bfloat16)
            if local.device.type == "cpu" and (not fused_cpu or low_precision or local.numel() >= CPU_SUM_MIN_ELEMENTS):
                self._summed.append((param, torch.float32 if low_precision else None))
            else:
                groups.setdefault((local.device, local.dtype), []).append(param)
        fused: list[Pass] = [
            (group, torch.zeros(1, device=device), torch.ones(1, device=device), [], [])
            for (device, _), group in groups.items()
        ]
        # The sums are checked by the CPU's fused pass too, so a step reads one flag per device,
        # not one number per summed gradient. Without the fused kernel on CPU, each sum is read.
        self._read_each = [] if fused_cpu else self._summed
        if self._summed and fused_cpu:
            cpu = [i for i, ((device, _), _) in enumerate(groups.items()) if device.type == "cpu"]
            if not cpu:
                fused.append(([], torch.zeros(1), torch.ones(1), [], []))
            _, _, _, plain, low = fused[cpu[0] if cpu else -1]
            for param, dtype in self._summed:
                (plain if dtype is None else low).append(param)
        # Per pass: (parameters, flag, 1.0, parameters summed in their dtype, in float32).
        self._fused = fused

    def __call__(self) -> bool:
        """True when some gradient is non-finite. Reads results on the host: a sync.

        The per-step work is C-level ``map``/``filter`` over lists resolved in ``__init__``: a
        few Python operations a pass, whatever the number of parameters."""
        grad_of = _local_grad if self.sharded else _grad
        non_finite = bool(self._read_each) and not all(
            math.isfinite(grad.sum(dtype=dtype).item())
            for param, dtype in self._read_each
            if (grad := grad_of(param)) is not None
        )
        for params, found, one, plain, low in self._fused:
            grads = list(filter(_present, map(grad_of, params)))
            if plain:
                grads += map(_sum, filter(_present, map(grad_of, plain)))
            if low:
                grads += map(_sum_float32, filter(_present, map(grad_of, low)))
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        for fused in self._fused:  # every pass is launched before the first read
            found = fused[1]
            if found.item():  # host sync; reset only after it was set, so a clean step skips it
                found.zero_()
                non_finite = True
        if self.sharded:
            # Each rank checked only its own shard: a NaN in one rank's shard must reach the
            # others, or that rank retries while they step. One all-reduce (MAX) of one flag.
            self._flag.fill_(1.0 if non_finite else 0.0)
            non_finite = collectives.any_rank(self._flag)
        return non_finite


#: One fused pass: (parameters, flag, 1.0, parameters summed in their dtype, in float32).
Pass: TypeAlias = tuple[list[nn.Parameter], torch.Tensor, torch.Tensor, list[nn.Parameter], list[nn.Parameter]]
_grad = attrgetter("grad")
_present = partial(is_not, None)
_sum = torch.Tensor.sum
_sum_float32 = partial(torch.sum, dtype=torch.float32)


def _local_grad(param: nn.Parameter) -> torch.Tensor | None:
    grad = param.grad
    return None if grad is None else local_part(grad)


def _fused_check_runs_on_cpu() -> bool:
    """Whether this torch has the fused check for CPU tensors (older releases only had CUDA's)."""
    probe, found = torch.tensor([math.inf]), torch.zeros(1)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([probe], found, torch.ones(1))
    except (RuntimeError, NotImplementedError):
        return False
    return bool(found.item())


class Stepper:
    """The tensor work of a step, configured once from the trainer's built components."""

    @classmethod
    def for_trainer(cls, trainer: BaseTrainer, agreement: LossNoneAgreement | None) -> Stepper:
        """The stepper of a built trainer: its components and settings. Accumulation skips the
        gradient all-reduce on all but the last micro-batch (``no_sync``) when the model offers
        it and ``no_sync_accumulate`` allows it."""
        model, accumulation = trainer.model, trainer.gradient_accumulation_steps
        no_sync = getattr(model, "no_sync", None) if trainer.no_sync_accumulate and accumulation > 1 else None
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

    def micro(self, forward: Callable[[Any], Any], batch: Any, last: bool) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward of one micro-batch; returns (unscaled loss, records) detached.

        The loss is divided by the accumulation count so the accumulated gradient is the mean
        over the step's micro-batches. ``no_sync`` wraps forward and backward of every micro-batch
        but the last, so DDP all-reduces once per step.

        With ``loss_none_agreement`` (an ``agreement``), the ranks agree between forward and backward: the
        loss is None on every rank when it was None on any, so nobody runs backward and DDP's
        gradient all-reduces stay paired (one small host collective, see ``trainfsm.collectives``).
        """
        if self.no_sync is not None and not last:
            with self.no_sync():
                return self._forward_backward(forward, batch)
        return self._forward_backward(forward, batch)

    def _forward_backward(self, forward: Callable[[Any], Any], batch: Any) -> tuple[torch.Tensor | None, Any]:
        if self.autocast is not None:
            with self.autocast:  # backward runs outside autocast, as PyTorch recommends
                out = forward(batch)
        else:
            out = forward(batch)
        loss, records = _check_forward_result(out)
        # With an agreement, a wait for every rank (a host collective, not a device sync): no rank
        # may start the backward of a micro-batch that another rank skips, or DDP's all-reduces
        # pair up wrongly. It says skip whenever this rank's loss is None.
        if (self.agreement is not None and self.agreement.skip(loss is None)) or loss is None:
            return None, records
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
