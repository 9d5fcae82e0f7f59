"""Random generator states: what exact resume needs beyond tensors.

Saved per rank (each rank draws its own dropout masks and shuffles) and restored in RESTORE, before
the data iterator is created, so a shuffling DataLoader draws the same permutation it drew before
the interruption. States are stored as tensors and plain containers so that checkpoints load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # only if someone uses it: importing it costs ~0.1 s
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        for device in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[device], device)
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        numpy.random.set_state(
            (
                saved["kind"],
                saved["keys"].numpy().astype("uint32"),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )
