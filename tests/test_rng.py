"""Random streams in a checkpoint: captured, written, loaded with ``weights_only=True``, restored to
the same draws; numpy's included, and checkpoints of the earlier format load too."""

from __future__ import annotations

import io
import random
from typing import Any

import numpy
import pytest
import torch

from trainfsm import rng


def draws() -> tuple[Any, ...]:
    return random.random(), torch.rand(2).tolist(), numpy.random.rand(), numpy.random.standard_normal()


def through_a_file(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def test_the_streams_restored_from_a_file_draw_what_they_drew_after_the_capture() -> None:
    numpy.random.seed(3)
    numpy.random.standard_normal()  # numpy now holds a cached gaussian: part of its state
    state = rng.capture()
    expected = draws()
    draws()
    rng.restore(through_a_file(state))
    assert draws() == expected


def test_numpy_keys_are_kept_as_bytes_not_converted() -> None:
    # A save blocks the loop for the capture: converting the key to an int64 tensor costs ~55 µs of ~220.
    state = rng.capture()
    keys = numpy.random.get_state()[1]
    assert state["numpy"]["keys"] == keys.tobytes() and len(state["numpy"]["keys"]) == 624 * 4


def test_a_state_of_the_earlier_format_with_numpys_keys_as_a_tensor_restores_the_same_draws() -> None:
    state = rng.capture()
    expected = draws()
    state["numpy"]["keys"] = torch.from_numpy(
        numpy.frombuffer(state["numpy"]["keys"], dtype=numpy.uint32).astype("int64")
    )
    rng.restore(through_a_file(state))
    assert draws() == expected


def test_capture_does_not_ask_whether_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    # Initialised implies available: the question costs ~50 µs at each save, caches cold.
    def asked() -> bool:
        raise AssertionError("torch.cuda.is_available() called")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    assert "cuda" not in rng.capture()
