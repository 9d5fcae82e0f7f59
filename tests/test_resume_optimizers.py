"""Saving never steps the optimizer, and resume is exact for every optimizer the tests use.

torch's ``get_state_dict`` gives an optimizer without state a zero gradient and a zero-rate step
before it builds its state dict; for SGD without momentum that happened at every save (issue 35).
``trainfsm.torch_workarounds.capture_model_and_optimizer`` builds the same state dict without the
step, and ``load_model_and_optimizer`` loads a state without per-parameter entries without one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import read_events
from tests.test_checkpointing import Trainer, params
from trainfsm import BaseHook, CheckpointingHook
from trainfsm.checkpoint.store import CheckpointStore
from trainfsm.torch_workarounds import capture_model_and_optimizer, load_model_and_optimizer

Optimizer = Callable[[Any], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),  # no momentum: no state, ever
    "sgd_weight_decay": lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.01),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05),
}
STATELESS = ("sgd", "sgd_weight_decay")


class Counted(Trainer):
    """The checkpointing tests' trainer (dropout, shuffle, a StepLR) with another optimizer, whose
    steps are counted by a step hook, as a user's own hook would count them."""

    def __init__(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.make_optimizer = optimizer
        self.optimizer_steps = 0

    def build_optimizer(self) -> torch.optim.Optimizer:
        optimizer = self.make_optimizer(self.model.parameters())  # type: ignore[union-attr]

        def count(*_: Any) -> None:
            self.optimizer_steps += 1

        optimizer.register_step_pre_hook(count)
        return optimizer


def train(workspace: Path, optimizer: Optimizer, steps: int, **hook: Any) -> Counted:
    hook.setdefault("interval", 1)
    trainer = Counted(optimizer, CheckpointingHook(**hook), max_steps=steps, workspace=workspace)
    torch.manual_seed(1)
    random.seed(1)
    trainer.train()
    return trainer


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_save_takes_no_optimizer_step(tmp_path: Path, name: str) -> None:
    trainer = train(tmp_path, OPTIMIZERS[name], 4)
    assert len([e for e in read_events(tmp_path) if e["event"] == "checkpoint_saved"]) == 4
    assert trainer.optimizer_steps == 4  # one per training step; torch's capture would add one per save (SGD)
    optimizer = trainer.optimizer
    assert optimizer is not None
    assert all(p.grad is None for g in optimizer.param_groups for p in g["params"])


def test_a_state_dict_before_the_first_step_invents_no_optimizer_state(tmp_path: Path) -> None:
    # A save before Adam's first real step (a grad scaler skipped them all) must not give it a step
    # 1 with zero moments that the run never had: the training after it would differ.
    captured: list[dict[str, Any]] = []

    class Capture(BaseHook):
        def on_before_train(self, trainer: Any) -> None:
            captured.append(trainer.state_dict())

    class Early(Counted):
        def build_hooks(self) -> list[Any]:
            return [Capture()]

    trainer = Early(OPTIMIZERS["adam"], max_steps=1, workspace=tmp_path)
    trainer.train()
    assert captured[0]["optimizer"]["state"] == {} and trainer.optimizer_steps == 1
    assert all(state["step"] == 1 for state in trainer.optimizer.state.values())  # type: ignore[union-attr]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_exact_for_every_optimizer(tmp_path: Path, name: str) -> None:
    straight = train(tmp_path / "a", OPTIMIZERS[name], 9, interval=4)
    train(tmp_path / "b", OPTIMIZERS[name], 6, interval=3)  # interrupted mid-epoch, checkpoint at step 6
    torch.manual_seed(999)  # a different process state: everything must come from the checkpoint
    random.seed(999)
    resumed = Counted(OPTIMIZERS[name], CheckpointingHook(interval=4), max_steps=9, workspace=tmp_path / "b")
    resumed.train()
    # Loading a state with entries goes through torch's set_state_dict, which first steps a fresh
    # optimizer once at a zero rate (in RESTORE, once); one without entries loads with no step.
    assert resumed.attempt == 1 and resumed.optimizer_steps == (3 if name in STATELESS else 4)
    for a, b in zip(params(straight), params(resumed), strict=True):
        assert torch.equal(a, b)
    assert straight.optimizer is not None and resumed.optimizer is not None
    assert straight.optimizer.state_dict()["param_groups"] == resumed.optimizer.state_dict()["param_groups"]


def _model_and_sgd() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01, "weight_decay": 0.1}]
    return model, torch.optim.SGD(groups, lr=0.1)


@pytest.mark.parametrize("flatten", [False, True])
def test_the_state_dict_built_without_a_step_is_the_one_torch_builds_with_it(flatten: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True) if flatten else None
    model, optimizer = _model_and_sgd()
    ours = capture_model_and_optimizer(model, optimizer, options)
    steps: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    theirs = get_state_dict(model, optimizer, options=options)
    assert ours[1] == theirs[1]
    assert ours[0].keys() == theirs[0].keys() and all(torch.equal(ours[0][k], theirs[0][k]) for k in ours[0])
    # torch still steps an optimizer without state to build it: when this fails, torch stopped,
    # and capture_model_and_optimizer can go back to get_state_dict.
    assert steps == [1]


def test_an_optimizer_state_without_entries_loads_without_a_step() -> None:
    source, saved_optimizer = _model_and_sgd()
    model_state, optim_state = capture_model_and_optimizer(source, saved_optimizer, None)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    adam = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.5)
    steps: list[int] = []
    adam.register_step_pre_hook(lambda *_: steps.append(1))
    adam_state = {"state": {}, "param_groups": [{**g, "lr": 0.25} for g in optim_state["param_groups"]]}
    load_model_and_optimizer(model, adam, model_state, adam_state, None)
    assert steps == [] and not adam.state  # torch's set_state_dict would step it (and create its state)
    assert [g["lr"] for g in adam.param_groups] == [0.25, 0.25]
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), model.parameters(), strict=True))
    with pytest.raises(ValueError, match=r"the checkpoint's optimizer has 2 parameter groups of \[2, 2\] parameters"):
        load_model_and_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), model_state, optim_state, None)


def test_checkpoints_saved_by_torchs_step_still_load(tmp_path: Path) -> None:
    # Before issue 35 an SGD checkpoint was built by get_state_dict (after its step): the same
    # format, so it loads the same way.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _model_and_sgd()
    model_state, optim_state = get_state_dict(model, optimizer)
    CheckpointStore(tmp_path).save(
        3, {"model": {"model": model_state}, "training_state": {"o": optim_state}}, keep=False
    )
    loaded = CheckpointStore.load(tmp_path / "3")
    fresh, sgd = _model_and_sgd()
    load_model_and_optimizer(fresh, sgd, loaded["model"]["model"], loaded["training_state"]["o"], None)
    assert sgd.state_dict() == optimizer.state_dict()
