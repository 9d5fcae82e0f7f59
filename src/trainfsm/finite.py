"""Whether every gradient is finite: one read of each gradient, one host read per pass.

Why this shape (the figures are in docs/guides/performance.md, "The finite check"):

- The fused kernel ``GradScaler`` uses for fp16 (``_amp_foreach_non_finite_check_and_unscale_``),
  called with an inverse scale of exactly 1.0, checks a whole list of gradients in one dispatch and
  leaves them bit-identical (x * 1.0 == x); its flag is read once.
- It writes every element, though, where a sum only reads. So on CPU it serves the many small
  tensors (biases, norms), while each large one is summed (NaN and infinities propagate into a sum)
  and the sums join the fused pass, so a step still reads one flag.
- A gradient whose elements sum past the float range (~3.4e38) counts as non-finite too; stepping
  it would be just as wrong. Low-precision CPU gradients are summed in float32 for that reason.
- On accelerators per-tensor host reads would each be a sync, so every gradient there goes
  through the fused kernel and its flag is the one read.
- With a model sharded over ranks (FSDP2), each rank checks its own shards and one all-reduce
  (MAX) of the flag makes the verdict common: a NaN in one rank's shard must stop every rank.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from trainfsm import activity, collectives
from trainfsm.utils import local_part

#: CPU gradients with at least this many elements are summed one by one; smaller ones share the
#: fused pass (where the two cost the same: docs/guides/performance.md, "The finite check").
CPU_SUM_MIN_ELEMENTS = 32768


class Pass(NamedTuple):
    """One fused check: the gradients of ``params`` as they are, and the sums of ``summed`` (in
    their dtype) and of ``summed_in_float32``, checked together into ``flag``."""

    params: list[nn.Parameter]
    flag: torch.Tensor
    one: torch.Tensor  # the inverse scale: exactly 1.0, so the gradients stay as they are
    summed: list[nn.Parameter]
    summed_in_float32: list[nn.Parameter]


class FiniteCheck:
    """Called after a step's backward: True when some gradient is non-finite (see the module)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.sharded = any(local_part(param) is not param for param in params)
        if self.sharded:  # the flag lives where the collective runs: CUDA for nccl, CPU for gloo
            import torch.distributed as dist

            device = params[0].device if dist.get_backend() == "nccl" else torch.device("cpu")
            self._flag = torch.zeros(1, device=device)
        fused_cpu = _fused_check_runs_on_cpu()
        summed: list[tuple[nn.Parameter, bool]] = []  # (parameter, sum in float32)
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for param in params:
            local = local_part(param)
            low_precision = local.dtype in (torch.float16, torch.bfloat16)
            if local.device.type == "cpu" and (not fused_cpu or low_precision or local.numel() >= CPU_SUM_MIN_ELEMENTS):
                summed.append((param, low_precision))
            else:
                groups.setdefault((local.device, local.dtype), []).append(param)
        self._passes = [
            Pass(group, torch.zeros(1, device=device), torch.ones(1, device=device), [], [])
            for (device, _), group in groups.items()
        ]
        if any(check.flag.device.type != "cpu" for check in self._passes) or (
            self.sharded and self._flag.device.type != "cpu"
        ):
            global _reads_a_device
            _reads_a_device = True
        # Without the fused kernel on CPU (older torch), each sum is read on its own.
        self._read_each = [] if fused_cpu else summed
        if summed and fused_cpu:  # the sums join the CPU pass: one flag per device, not one read per sum
            cpu = next((p for p in self._passes if p.flag.device.type == "cpu"), None)
            if cpu is None:
                cpu = Pass([], torch.zeros(1), torch.ones(1), [], [])
                self._passes.append(cpu)
            for param, in_float32 in summed:
                (cpu.summed_in_float32 if in_float32 else cpu.summed).append(param)

    def __call__(self) -> bool:
        """True when some gradient is non-finite. Reads results on the host: a sync."""
        non_finite = False
        for param, in_float32 in self._read_each:
            for grad in self._grads([param]):
                if not math.isfinite(grad.sum(dtype=torch.float32 if in_float32 else None).item()):
                    non_finite = True
        for check in self._passes:
            grads = self._grads(check.params)
            grads += [grad.sum() for grad in self._grads(check.summed)]
            grads += [grad.sum(dtype=torch.float32) for grad in self._grads(check.summed_in_float32)]
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, check.flag, check.one)
        for check in self._passes:  # every pass is launched before the first read
            if check.flag.item():  # host sync; reset only after it was set, so a clean step skips it
                check.flag.zero_()
                non_finite = True
        if self.sharded:
            self._flag.fill_(1.0 if non_finite else 0.0)
            non_finite = collectives.any_rank(self._flag)  # one all-reduce (MAX) of one flag
        return non_finite

    def _grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The gradients that exist (this rank's part of a sharded one)."""
        if self.sharded:
            return [local_part(grad) for param in params if (grad := param.grad) is not None]
        return [grad for param in params if (grad := param.grad) is not None]


def _fused_check_runs_on_cpu() -> bool:
    """Whether this torch has the fused check for CPU tensors (older releases only had CUDA's)."""
    probe, found = torch.tensor([math.inf]), torch.zeros(1)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([probe], found, torch.ones(1))
    except (RuntimeError, NotImplementedError):
        return False
    return bool(found.item())


#: Whether a FiniteCheck reads a flag on an accelerator: its host read then waits for every kernel
#: queued before it, which a stall there should say (set when one is made; a process trains on one kind).
_reads_a_device = False


def _describe_check(frame: Any, inner: Any) -> tuple[str, bool]:
    """The finite check's frame for a stall: in C called from it (its host read) on an accelerator,
    the wait is for the device: a step stuck in a kernel (or a collective inside the model's
    backward) is seen here by the host."""
    if inner is None and _reads_a_device:
        return "the finite check of the gradients, whose host read waits for the GPU's queued kernels", False
    return "the finite check of the gradients", False


activity.name(FiniteCheck.__call__, _describe_check)
