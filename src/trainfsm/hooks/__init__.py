"""Hooks: one module each, every module here defines a hook.

The names below are imported on first use (PEP 562), so ``from trainfsm.hooks.base import
BaseHook`` (what the trainer needs) loads no built-in hook, and a hook's optional dependencies
(wandb, tensorboard, pillow) are imported only when that hook is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from trainfsm.hooks.base import BaseHook
    from trainfsm.hooks.checkpointing import CheckpointingHook
    from trainfsm.hooks.cuda_memory import CUDAMaxMemoryHook, CudaMaxMemoryHook, CudaMemoryUnavailableWarning
    from trainfsm.hooks.early_stopping import EarlyStoppingHook
    from trainfsm.hooks.ema import EMAHook, EmaHook
    from trainfsm.hooks.image_files import ImageFileLoggerHook
    from trainfsm.hooks.logging_hook import LoggingHook
    from trainfsm.hooks.progress import ProgressHook
    from trainfsm.hooks.stats import StatsHook, TrainingStats
    from trainfsm.hooks.tensorboard import TensorBoardHook
    from trainfsm.hooks.validation import ValidationHook
    from trainfsm.hooks.wandb import WandbHook

#: Public name -> the module that defines it.
_SOURCES: Final = {
    "BaseHook": "base",
    "CheckpointingHook": "checkpointing",
    "CUDAMaxMemoryHook": "cuda_memory",
    "CudaMaxMemoryHook": "cuda_memory",
    "CudaMemoryUnavailableWarning": "cuda_memory",
    "EarlyStoppingHook": "early_stopping",
    "EMAHook": "ema",
    "EmaHook": "ema",
    "ImageFileLoggerHook": "image_files",
    "LoggingHook": "logging_hook",
    "ProgressHook": "progress",
    "StatsHook": "stats",
    "TrainingStats": "stats",
    "TensorBoardHook": "tensorboard",
    "ValidationHook": "validation",
    "WandbHook": "wandb",
}

__all__ = [
    "BaseHook",
    "CUDAMaxMemoryHook",
    "CheckpointingHook",
    "CudaMaxMemoryHook",
    "CudaMemoryUnavailableWarning",
    "EMAHook",
    "EarlyStoppingHook",
    "EmaHook",
    "ImageFileLoggerHook",
    "LoggingHook",
    "ProgressHook",
    "StatsHook",
    "TensorBoardHook",
    "TrainingStats",
    "ValidationHook",
    "WandbHook",
]


def __getattr__(name: str) -> Any:
    """Import a hook on first use (PEP 562); later lookups find it in the module's globals."""
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module 'trainfsm.hooks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainfsm.hooks.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
