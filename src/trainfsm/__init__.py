"""trainfsm: a PyTorch training loop whose control flow is an explicit, audited state machine.

``import trainfsm`` is light: the names below are imported on first use (PEP 562), so that the
offline commands (``trainfsm audit``, ``trace``, ``plot``, ``diagram``), which read JSON, start
without importing torch (about 2 s). ``from trainfsm import BaseTrainer`` works as before.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from trainfsm.checkpoint.store import CheckpointError
    from trainfsm.collectives import LossNoneWarning
    from trainfsm.data_cursor import DataReshardError, EpochWarning
    from trainfsm.ddp_buckets import DDPBucketsWarning
    from trainfsm.hooks import (
        BaseHook,
        CheckpointingHook,
        CUDAMaxMemoryHook,
        CudaMaxMemoryHook,
        CudaMemoryUnavailableWarning,
        EarlyStoppingHook,
        EMAHook,
        EmaHook,
        ImageFileLoggerHook,
        LoggingHook,
        ProgressHook,
        StatsHook,
        TensorBoardHook,
        TrainingStats,
        ValidationHook,
        WandbHook,
    )
    from trainfsm.machine import STATES, TRANSITIONS
    from trainfsm.torch_workarounds import GroupOutlivesDestroyWarning
    from trainfsm.trainer import BaseTrainer
    from trainfsm.utils import key_average, map_nested_tensor, unwrap

__version__ = "0.1.0"

#: Where each public name lives; all but ``trainfsm.machine`` import torch.
_SOURCES: Final = {
    "STATES": "trainfsm.machine",
    "TRANSITIONS": "trainfsm.machine",
    "CheckpointError": "trainfsm.checkpoint.store",
    **dict.fromkeys(
        (
            "BaseHook",
            "CheckpointingHook",
            "CUDAMaxMemoryHook",
            "CudaMaxMemoryHook",
            "CudaMemoryUnavailableWarning",
            "EarlyStoppingHook",
            "EMAHook",
            "EmaHook",
            "EpochWarning",
            "ImageFileLoggerHook",
            "LoggingHook",
            "ProgressHook",
            "StatsHook",
            "TensorBoardHook",
            "TrainingStats",
            "ValidationHook",
            "WandbHook",
        ),
        "trainfsm.hooks",
    ),
    "GroupOutlivesDestroyWarning": "trainfsm.torch_workarounds",
    "DDPBucketsWarning": "trainfsm.ddp_buckets",
    "DataReshardError": "trainfsm.data_cursor",
    "EpochWarning": "trainfsm.data_cursor",
    "BaseTrainer": "trainfsm.trainer",
    "LossNoneWarning": "trainfsm.collectives",
    "key_average": "trainfsm.utils",
    "map_nested_tensor": "trainfsm.utils",
    "unwrap": "trainfsm.utils",
}
_TORCH_FREE: Final = frozenset({"trainfsm.machine"})

__all__ = [
    "STATES",
    "TRANSITIONS",
    "BaseHook",
    "BaseTrainer",
    "CUDAMaxMemoryHook",
    "CheckpointError",
    "CheckpointingHook",
    "CudaMaxMemoryHook",
    "CudaMemoryUnavailableWarning",
    "DDPBucketsWarning",
    "DataReshardError",
    "EMAHook",
    "EarlyStoppingHook",
    "EmaHook",
    "EpochWarning",
    "GroupOutlivesDestroyWarning",
    "ImageFileLoggerHook",
    "LoggingHook",
    "LossNoneWarning",
    "ProgressHook",
    "StatsHook",
    "TensorBoardHook",
    "TrainingStats",
    "ValidationHook",
    "WandbHook",
    "__version__",
    "key_average",
    "map_nested_tensor",
    "unwrap",
]


def _import_collectives_before_any_group() -> None:
    # Else a group created from here on can outlive its destroy (see trainfsm.torch_workarounds).
    from trainfsm.torch_workarounds import import_collectives_before_any_group

    import_collectives_before_any_group()


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562); later lookups find it in the module's globals."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'trainfsm' has no attribute {name!r}")
    if source not in _TORCH_FREE:
        _import_collectives_before_any_group()
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if "torch" in sys.modules:
    # The script imported torch first (as isort orders `import torch` before `import trainfsm`):
    # it may create its process group next, before it uses any name of ours, so do it now.
    _import_collectives_before_any_group()
