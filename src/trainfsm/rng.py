"""Random generator states: what exact resume needs beyond tensors.

Saved per rank (each rank draws its own dropout masks and shuffles) and restored in RESTORE, before
the data iterator is created, so a shuffling DataLoader draws the same permutation it drew before
the interruption. States are stored as tensors, bytes and plain containers so that checkpoints
load with ``torch.load(weights_only=True)``.

``capture`` runs in every checkpoint, after a step that left the CPU's caches cold, and an
asynchronous save blocks the loop for it: numpy's key is kept as its bytes (a copy), not converted
to an int64 tensor (two more allocations and conversions: ~55 µs of ~220 µs). Checkpoints written
before that, with the tensor, load as well.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    # Initialised implies available; asking for availability first costs ~50 µs at a save, whose
    # CPU caches the step before left cold.
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # only if someone uses it: importing it costs ~0.1 s
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": keys.tobytes(),  # uint32, native order: restored on a machine of the same order
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def seeded(seed: int) -> dict[str, Any]:
    """A state like ``capture``'s for streams started from ``seed`` (a rank the saving run did
    not have, ``trainfsm.data_order.derived_seed``); ``restore`` seeds CUDA and numpy from it."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return {"python": random.Random(seed).getstate(), "torch": generator.get_state(), "seed": seed}


def restore(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "seed" in state:  # ``seeded``: the other generators start from the same seed
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(state["seed"])
        loaded = sys.modules.get("numpy")  # only if someone uses it, as in ``capture``
        if loaded is not None:
            loaded.random.seed(state["seed"] % 2**32)
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
                _numpy_keys(numpy, saved["keys"]),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )


def _numpy_keys(numpy: Any, keys: Any) -> Any:
    """numpy's key from its bytes, or from the int64 tensor of checkpoints written before."""
    if isinstance(keys, bytes):
        return numpy.frombuffer(keys, dtype=numpy.uint32).copy()
    return keys.numpy().astype("uint32")
