"""A model nothing shards gets torch's state dicts without torch's per-call checks
(``trainfsm.plain_state``): the same keys in the same order, the same tensors, the same optimizer
state and groups as ``get_state_dict``, for each kind of model and optimizer it serves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainfsm import torch_workarounds
from trainfsm.plain_state import plain_state_dicts


def same(ours: Any, theirs: Any) -> bool:
    """Equal structure, keys in the same order, and the same tensors (storage and values)."""
    if isinstance(theirs, torch.Tensor):
        return isinstance(ours, torch.Tensor) and ours.data_ptr() == theirs.data_ptr() and torch.equal(ours, theirs)
    if isinstance(theirs, dict):
        return (
            isinstance(ours, dict)
            and list(ours) == list(theirs)
            and all(same(ours[key], theirs[key]) for key in theirs)
        )
    if isinstance(theirs, list | tuple):
        return type(ours) is type(theirs) and len(ours) == len(theirs) and all(map(same, ours, theirs))
    return bool(ours == theirs)


def stepped(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def with_batch_norm() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.randn(5, 4)


def adam_groups_and_a_parameter_without_state() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.used, self.unused = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(self.body(x))  # self.unused never gets a gradient, so no state

    model = TwoHeads()
    groups = [
        {"params": model.body.parameters()},
        {"params": [*model.used.parameters(), *model.unused.parameters()], "lr": 0.01, "weight_decay": 0.1},
    ]
    return model, torch.optim.AdamW(groups, lr=0.05), torch.randn(3, 4)


def tied_weights() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.out = nn.Linear(6, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(x))

    model = Tied()
    return model, torch.optim.Adam(model.parameters(), lr=0.01), torch.tensor([1, 2, 3])


def compiled() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model = torch.compile(inner)  # never called: its state dict's keys carry the _orig_mod. prefix
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped(inner, optimizer, torch.randn(2, 4))
    return model, optimizer, torch.randn(2, 4)  # type: ignore[return-value]


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]]] = {
    "batch_norm_sgd_momentum": with_batch_norm,
    "adamw_two_groups_one_parameter_without_state": adam_groups_and_a_parameter_without_state,
    "tied_weights_adam": tied_weights,
    "torch_compile": compiled,
}


@pytest.mark.parametrize("kind", MODELS)
def test_a_model_nothing_shards_gets_the_state_dicts_torch_builds(kind: str) -> None:
    torch.manual_seed(0)
    model, optimizer, inputs = MODELS[kind]()
    if kind != "torch_compile":
        stepped(model, optimizer, inputs)
    ours = plain_state_dicts(model, optimizer, None)
    assert ours is not None
    assert same(ours, get_state_dict(model, optimizer))
    assert same(plain_state_dicts(model, optimizer, None), ours)  # again, from the names kept


def test_a_ddp_model_gets_the_state_dicts_torch_builds_without_the_module_prefix() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        stepped(model, optimizer, torch.randn(3, 4))
        ours = plain_state_dicts(model, optimizer, None)
        assert ours is not None and list(ours[0]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
        assert same(ours, get_state_dict(model, optimizer))
    finally:
        dist.destroy_process_group()


def test_torch_builds_them_where_options_are_given() -> None:
    model, optimizer, inputs = with_batch_norm()
    stepped(model, optimizer, inputs)
    assert plain_state_dicts(model, optimizer, StateDictOptions(full_state_dict=True)) is None
    assert plain_state_dicts(model, optimizer, None) is not None


def test_an_optimizer_without_state_gets_its_param_groups_under_torchs_names_and_no_step() -> None:
    model, optimizer, _ = with_batch_norm()  # momentum, but no step yet: no state
    steps: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    ours = plain_state_dicts(model, optimizer, None)
    assert ours is not None and steps == []
    assert ours[1] == {
        "state": {},
        "param_groups": [
            {**optimizer.param_groups[0], "params": ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]}
        ],
    }


def test_a_save_of_a_model_nothing_shards_does_not_go_through_get_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    # An asynchronous save blocks the loop for all of get_state_dict's checks (1.2 ms of 1.7 ms
    # with a 12-layer model, against 1% of a 0.12 s synchronous save).
    from torch.distributed.checkpoint import state_dict as dsd

    model, optimizer, inputs = with_batch_norm()
    stepped(model, optimizer, inputs)
    expected = get_state_dict(model, optimizer)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("get_state_dict called for a model nothing shards")

    monkeypatch.setattr(dsd, "get_state_dict", refuse)
    assert same(torch_workarounds.capture_model_and_optimizer(model, optimizer, None), expected)


def test_an_optimizer_with_a_state_dict_hook_gets_what_its_hook_returns() -> None:
    # The groups are built directly only for torch's own state_dict() with no hook on it.
    model, optimizer, inputs = with_batch_norm()
    stepped(model, optimizer, inputs)

    def tagged(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state["param_groups"][0]["tag"] = "from the hook"
        return state

    optimizer.register_state_dict_post_hook(tagged)
    ours = plain_state_dicts(model, optimizer, None)
    assert ours is not None and ours[1]["param_groups"][0]["tag"] == "from the hook"
    assert same(ours, get_state_dict(model, optimizer))


def test_the_names_are_looked_up_once_while_model_and_optimizer_keep_their_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A save comes after a step that left the CPU's caches cold: walking the modules again costs.
    model, optimizer, inputs = with_batch_norm()
    stepped(model, optimizer, inputs)
    plain_state_dicts(model, optimizer, None)
    walks: list[int] = []
    named_parameters = nn.Module.named_parameters
    monkeypatch.setattr(nn.Module, "named_parameters", lambda *a, **k: walks.append(1) or named_parameters(*a, **k))
    again = plain_state_dicts(model, optimizer, None)
    assert walks == [] and same(again, get_state_dict(model, optimizer))


def test_a_param_group_added_after_a_save_is_named_at_the_next() -> None:
    model, optimizer, inputs = with_batch_norm()
    stepped(model, optimizer, inputs)
    plain_state_dicts(model, optimizer, None)
    model.append(nn.Linear(2, 3))
    optimizer.add_param_group({"params": model[4].parameters(), "lr": 0.5})
    stepped(model, optimizer, inputs)
    ours = plain_state_dicts(model, optimizer, None)
    assert ours is not None and ours[1]["param_groups"][1]["params"] == ["4.weight", "4.bias"]
    assert same(ours, get_state_dict(model, optimizer))


def test_a_parameter_moved_to_another_group_is_named_where_it_is_now() -> None:
    # The same parameters in the same order, grouped differently: the groups are read anew.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    first, second = model.parameters(), []
    optimizer = torch.optim.SGD([{"params": list(first)}, {"params": second, "lr": 0.5}], lr=0.1, momentum=0.9)
    stepped(model, optimizer, torch.randn(3, 4))
    plain_state_dicts(model, optimizer, None)
    optimizer.param_groups[1]["params"].insert(0, optimizer.param_groups[0]["params"].pop())
    ours = plain_state_dicts(model, optimizer, None)
    assert ours is not None and [g["params"] for g in ours[1]["param_groups"]] == [
        ["0.weight", "0.bias", "1.weight"],
        ["1.bias"],
    ]
    assert same(ours, get_state_dict(model, optimizer))


def test_a_module_renamed_after_a_save_saves_under_its_new_name() -> None:
    # The same parameters under other names: the model state's keys changed, so the names are looked up again.
    model = nn.Sequential()
    model.add_module("old", nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped(model, optimizer, torch.randn(3, 4))
    plain_state_dicts(model, optimizer, None)
    model._modules["new"] = model._modules.pop("old")
    ours = plain_state_dicts(model, optimizer, None)
    assert ours is not None and list(ours[1]["state"]) == ["new.weight", "new.bias"]
    assert same(ours, get_state_dict(model, optimizer))
