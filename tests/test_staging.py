"""What an asynchronous save copies before the loop goes on, what it copies on the writer thread,
and into which CPU tensors (``trainfsm.checkpoint.background.stage``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from trainfsm.checkpoint import background
from trainfsm.checkpoint.background import WriteTimes, _copy_then, stage


def staged_now(model: nn.Module, spare: list[torch.Tensor] | None = None) -> tuple[Any, list[Any]]:
    return stage({"model": {"model": model.state_dict()}}, SimpleNamespace(model=model), spare)  # type: ignore[arg-type]


def test_parameters_are_copied_later_and_buffers_now() -> None:
    model = nn.BatchNorm1d(3)
    staged, copies = staged_now(model)
    later = {source.data_ptr() for source, _ in copies}
    assert later == {model.weight.data_ptr(), model.bias.data_ptr()}
    model.running_mean.add_(1.0)  # the next forward, before the writer copied anything
    assert torch.equal(staged["model"]["model"]["running_mean"], torch.zeros(3))


def test_a_save_of_the_same_structure_copies_into_the_last_saves_tensors_in_their_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In order, each checked against its own spare: no pool of spares sorted by layout (the loop
    # waits for this after a step that left the CPU's caches cold).
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    _, first = staged_now(model)
    targets = [target for _, target in first]
    pooled: list[torch.Tensor] = []
    monkeypatch.setattr(background, "_layout", lambda tensor: pooled.append(tensor) or (tensor.shape, tensor.dtype))
    _, second = staged_now(model, targets)
    assert [target.data_ptr() for _, target in second] == [t.data_ptr() for t in targets] and pooled == []


def test_tensors_in_another_order_each_find_a_spare_of_their_layout_and_a_new_layout_a_new_tensor() -> None:
    spare = [torch.zeros(2), torch.zeros(3), torch.zeros(3)]
    parts = {"optimizer": {"a": torch.ones(3), "b": torch.ones(2), "c": torch.ones(5), "d": torch.ones(3)}}
    _, copies = stage(parts, SimpleNamespace(model=None), spare)  # type: ignore[arg-type]
    targets = [target for _, target in copies]
    assert targets[0] is spare[1] and targets[1] is spare[0] and targets[3] is spare[2]
    assert targets[2].shape == (5,) and all(targets[2] is not s for s in spare)


def test_a_parameter_added_to_the_model_after_the_first_save_is_copied_before_the_loop_goes_on() -> None:
    # Its parameters are kept from the first save: a new one is not among them, so it is copied
    # as a buffer is, at once (slower, never wrong).
    model = nn.Sequential(nn.Linear(2, 2))
    staged_now(model)
    model.append(nn.Linear(2, 1))
    staged, copies = staged_now(model)
    assert model[1].weight.data_ptr() not in {source.data_ptr() for source, _ in copies}
    before = model[1].weight.detach().clone()
    with torch.no_grad():
        model[1].weight.add_(1.0)
    assert torch.equal(staged["model"]["model"]["1.weight"], before)


def test_a_parameter_whose_storage_was_swapped_is_still_copied_later() -> None:
    model = nn.Linear(2, 2)
    staged_now(model)
    model.weight.data = torch.randn(2, 2)
    _, copies = staged_now(model)
    assert model.weight.data_ptr() in {source.data_ptr() for source, _ in copies}


def test_the_model_states_metadata_is_staged_with_it() -> None:
    # model.state_dict()'s _metadata (module versions) is what load_state_dict reads back.
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    state = model.state_dict()
    staged, _ = staged_now(model)
    written = staged["model"]["model"]
    assert type(written) is OrderedDict and written._metadata == state._metadata  # type: ignore[attr-defined]


def test_pythons_random_state_is_staged_with_the_same_tuple_of_625_ints() -> None:
    import random

    state = random.getstate()
    staged, copies = stage({"ranks": [{"python": state}]}, SimpleNamespace(model=None))  # type: ignore[arg-type]
    assert staged["ranks"][0]["python"] == state and staged["ranks"][0]["python"][1] is state[1] and copies == []


def test_the_writer_threads_copy_of_a_tensor_that_requires_grad_records_no_graph() -> None:
    source = torch.ones(3, requires_grad=True)
    staged, copies = stage({"hooks": {"ema": source}}, SimpleNamespace(model=None))  # type: ignore[arg-type]
    done = threading.Lock()
    done.acquire()  # released once the copies are made
    clock = WriteTimes()
    _copy_then(copies, done, lambda: None, clock)
    written = staged["hooks"]["ema"]
    assert not done.locked() and torch.equal(written, source.detach()) and not written.requires_grad
    assert clock.began is None and clock.slowest > 0  # the writer timed its copies and write
    assert written.grad_fn is None
