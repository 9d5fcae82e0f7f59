"""The public helpers: map_nested_tensor, key_average, unwrap (and the trainer's unwrap)."""

from __future__ import annotations

import types
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from tests.helpers import TinyTrainer, make_model
from trainfsm import key_average, map_nested_tensor, unwrap
from trainfsm.utils import is_distributed_wrapper

# torch.compile's first use imports TorchScript modules that warn about their own deprecation.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

Pair = namedtuple("Pair", ["left", "right"])


def double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


# ---------------------------------------------------------------- map_nested_tensor
def test_map_nested_tensor_docs_example():
    x, y = torch.randn(2, 3), torch.randn(4, 5)
    out = map_nested_tensor(lambda t: t.to(torch.float64), {"x": x, "y": [y]})
    assert set(out) == {"x", "y"}
    assert out["x"].dtype == torch.float64 and torch.equal(out["x"], x.double())
    assert isinstance(out["y"], list) and len(out["y"]) == 1
    assert torch.equal(out["y"][0], y.double())


def test_map_nested_tensor_applies_to_a_bare_tensor():
    assert torch.equal(map_nested_tensor(double, torch.tensor([1.0, 2.0])), torch.tensor([2.0, 4.0]))


def test_map_nested_tensor_keeps_container_types():
    obj = (
        [torch.tensor(1.0)],
        (torch.tensor(2.0),),
        Pair(torch.tensor(3.0), right={"k": torch.tensor(4.0)}),
        OrderedDict(a=torch.tensor(5.0)),
    )
    out = map_nested_tensor(double, obj)
    assert type(out) is tuple
    assert type(out[0]) is list and out[0][0].item() == 2.0
    assert type(out[1]) is tuple and out[1][0].item() == 4.0
    assert type(out[2]) is Pair and out[2].left.item() == 6.0 and out[2].right["k"].item() == 8.0
    assert type(out[3]) is OrderedDict and out[3]["a"].item() == 10.0


def test_map_nested_tensor_keeps_a_defaultdict_type():
    out = map_nested_tensor(double, defaultdict(list, {"a": torch.tensor(1.0)}))
    assert type(out) is defaultdict
    assert out["a"].item() == 2.0


def test_map_nested_tensor_keeps_a_defaultdicts_factory():
    out = map_nested_tensor(double, defaultdict(list, {"a": torch.tensor(1.0)}))
    assert out.default_factory is list
    assert out["missing"] == []


def test_map_nested_tensor_returns_a_dict_for_mappings_it_cannot_rebuild():
    out = map_nested_tensor(double, types.MappingProxyType({"a": torch.tensor(1.0)}))
    assert type(out) is dict and out["a"].item() == 2.0


def test_map_nested_tensor_leaves_other_values_alone():
    marker = object()
    obj = {"s": "text", "n": None, "i": 3, "f": 1.5, "set": {1, 2}, "o": marker}
    out = map_nested_tensor(double, obj)
    assert out == {"s": "text", "n": None, "i": 3, "f": 1.5, "set": {1, 2}, "o": marker}
    assert out["o"] is marker


def test_map_nested_tensor_does_not_modify_its_input():
    t = torch.tensor(1.0)
    obj: dict[str, Any] = {"a": [t]}
    map_nested_tensor(double, obj)
    assert obj["a"][0] is t and t.item() == 1.0


# ---------------------------------------------------------------- key_average
def test_key_average_docs_example():
    records = [
        {"loss": 0.5, "metrics": {"acc": 0.9}},
        {"loss": 0.6, "metrics": {"acc": 0.85}},
    ]
    out = key_average(records)
    assert set(out) == {"loss", "metrics"}
    assert out["loss"] == pytest.approx(0.55)
    assert out["metrics"] == {"acc": pytest.approx(0.875)}


def test_key_average_docstring_example():
    assert key_average([{"loss": 1.0, "m": {"acc": 0.5}}, {"loss": 3.0, "m": {"acc": 1.0}}]) == {
        "loss": 2.0,
        "m": {"acc": 0.75},
    }


def test_key_average_averages_a_key_over_the_dicts_that_have_it():
    assert key_average([{"a": 1.0}, {"a": 3.0, "b": 5.0}, {"b": 7.0, "c": {"d": 2.0}}]) == {
        "a": 2.0,
        "b": 6.0,
        "c": {"d": 2.0},
    }


def test_key_average_averages_tensors_as_tensors():
    out = key_average([{"t": torch.tensor([1.0, 2.0])}, {"t": torch.tensor([3.0, 6.0])}])
    assert isinstance(out["t"], torch.Tensor)
    assert torch.equal(out["t"], torch.tensor([2.0, 4.0]))


def test_key_average_of_nothing_is_empty():
    assert key_average([]) == {}


def test_key_average_does_not_modify_its_input():
    records = [{"a": 1.0, "m": {"x": 2.0}}, {"a": 3.0, "m": {"x": 4.0}}]
    key_average(records)
    assert records == [{"a": 1.0, "m": {"x": 2.0}}, {"a": 3.0, "m": {"x": 4.0}}]


# ---------------------------------------------------------------- unwrap
def test_unwrap_returns_a_plain_module_itself():
    model = make_model()
    assert unwrap(model) is model


def test_unwrap_torch_compile():
    model = make_model()
    assert unwrap(torch.compile(model)) is model  # the wrapper alone; nothing is compiled


def test_unwrap_data_parallel():
    model = make_model()
    assert unwrap(nn.DataParallel(model)) is model


def test_unwrap_averaged_model():
    averaged = AveragedModel(make_model())
    assert unwrap(averaged) is averaged.module


def test_unwrap_nested_wrappers():
    model = make_model()
    assert unwrap(torch.compile(nn.DataParallel(model))) is model


@pytest.fixture
def process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_unwrap_ddp(process_group):
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    ddp = DistributedDataParallel(model)
    assert unwrap(ddp) is model
    assert unwrap(torch.compile(ddp)) is model


def test_is_distributed_wrapper(process_group):
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    assert not is_distributed_wrapper(model)
    assert not is_distributed_wrapper(nn.DataParallel(model))
    assert is_distributed_wrapper(DistributedDataParallel(model))
    assert is_distributed_wrapper(torch.compile(DistributedDataParallel(model)))


def test_trainer_unwrap_and_unwrapped_model():
    class CompiledTrainer(TinyTrainer):
        def build_model(self) -> nn.Module:
            return torch.compile(super().build_model())  # type: ignore[return-value]

        def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
            # Run the plain module: compiling is slow and beside the point here.
            out = self.unwrapped_model(input["x"])
            return nn.functional.mse_loss(out, input["y"]), {}

    trainer = CompiledTrainer(max_steps=1)
    trainer.train()
    inner = trainer.model._orig_mod  # type: ignore[union-attr]
    assert trainer.unwrapped_model is inner
    assert trainer.unwrap(trainer.model) is inner  # type: ignore[arg-type]
    assert isinstance(inner, nn.Linear)
