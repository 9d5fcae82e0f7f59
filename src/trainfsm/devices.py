"""Seeding and device choice, for scripts (the trainer itself takes ``device=`` and never seeds)."""

from __future__ import annotations

import os
import random

import torch


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when it is installed) and torch (CPU and every CUDA device)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32); got {seed!r}.")
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def get_device_type() -> str:
    """``"cuda"``, else ``"mps"`` (Apple), else ``"cpu"``."""
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def get_device(local_rank: int | None = None) -> torch.device:
    """This process's device: ``cuda:<local rank>`` under torchrun/SLURM (LOCAL_RANK, SLURM_LOCALID),
    else the first accelerator, else the CPU."""
    kind = get_device_type()
    if kind != "cuda":
        return torch.device(kind)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    if not 0 <= local_rank < torch.cuda.device_count():
        raise ValueError(f"local_rank {local_rank} is not a CUDA device (this node has {torch.cuda.device_count()}).")
    return torch.device("cuda", local_rank)
