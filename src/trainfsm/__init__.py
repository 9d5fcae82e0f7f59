"""trainfsm: a PyTorch training loop whose control flow is an explicit, audited state machine."""

from trainfsm.checkpoint import CheckpointError
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
from trainfsm.torch_workarounds import GroupOutlivesDestroyWarning, import_collectives_before_any_group
from trainfsm.trainer import BaseTrainer, LossNoneWarning
from trainfsm.utils import key_average, map_nested_tensor, unwrap

import_collectives_before_any_group()  # else a destroyed group can outlive its destroy (see there)

__version__ = "0.1.0"

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
    "EMAHook",
    "EarlyStoppingHook",
    "EmaHook",
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
