"""Hooks: one module each. Optional dependencies (wandb, tensorboard, pillow) are imported only
when a hook that needs them is used."""

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
