"""``CudaMaxMemoryHook``: the peak CUDA memory of each step, in ``trainer.step_info["max_memory"]``.

Why a hook: the peak is what tells how close a run is to running out of memory, and other hooks
(``ProgressHook``, ``LoggingHook``) report whatever ``step_info`` holds. It writes in
``on_step_info``, which runs before every hook's ``on_after_step``, so it may be listed anywhere.

Per step it reads ``torch.cuda.max_memory_allocated`` (allocator bookkeeping on
the host: no device sync) and resets the peak, so each value is the peak since the previous step's
end: the step itself and whatever ran between the two (a checkpoint, an evaluation at the step's
decision point). The peak is reset once before the first step.

On a trainer whose device is not CUDA there is nothing to measure: the hook says so once, as a
``CudaMemoryUnavailableWarning`` and a ``cuda_memory_unavailable`` audit event, sets nothing, and
from then on its per-step method only returns.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from trainfsm.hooks.base import BaseHook
from trainfsm.utils import user_stacklevel

if TYPE_CHECKING:
    from trainfsm.step_info import StepInfo
    from trainfsm.trainer import BaseTrainer

GIB = float(2**30)


class CudaMemoryUnavailableWarning(UserWarning):
    """``CudaMaxMemoryHook`` is on a trainer that does not run on CUDA: ``max_memory`` stays unset."""


class CudaMaxMemoryHook(BaseHook):
    """Put the step's peak allocated CUDA memory in GiB into ``trainer.step_info["max_memory"]`` (also
    ``"cuda_max_memory"``, trainloop 0.11's key). No arguments.
    """

    def __init__(self) -> None:
        self.device: torch.device | None = None  # set in on_before_train when the trainer is on CUDA

    def on_before_train(self, trainer: BaseTrainer) -> None:
        device = trainer.device
        if device.type != "cuda":
            self.device = None
            message = (
                f"CudaMaxMemoryHook: the trainer runs on {device}, not on CUDA, so step_info['max_memory'] "
                f"is not set. Train on a CUDA device or leave the hook out."
            )
            warnings.warn(message, CudaMemoryUnavailableWarning, stacklevel=user_stacklevel())
            trainer.events.warning("cuda_memory_unavailable", device=str(device))
            return
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)

    def on_step_info(self, trainer: BaseTrainer, info: StepInfo) -> None:
        device = self.device
        if device is None:
            return
        # trainloop 0.5's key, and 0.11's for those reading step_info with it
        info["max_memory"] = info["cuda_max_memory"] = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)


CUDAMaxMemoryHook = CudaMaxMemoryHook  # the other published spelling
