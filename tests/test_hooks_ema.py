"""EmaHook: the average equals a hand computation, survives save/resume bitwise, rejects bad arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.helpers import TinyTrainer
from trainfsm import BaseHook, CheckpointingHook
from trainfsm.hooks.ema import EMAHook, EmaHook


class Weights(BaseHook):
    """Copies the model's parameters after every step (listed before the EmaHook)."""

    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []

    def on_after_step(self, trainer: Any) -> None:
        self.after.append({k: v.detach().clone() for k, v in trainer.model.named_parameters()})


def ema_params(hook: EmaHook) -> dict[str, torch.Tensor]:
    assert hook.ema_model is not None
    return {k: v.detach().clone() for k, v in hook.ema_model.module.named_parameters()}


def test_three_steps_match_a_hand_computation(tmp_path: Path) -> None:
    weights, ema = Weights(), EmaHook(decay=0.9)
    TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[weights, ema]).train()
    w1, w2, w3 = weights.after
    for name in w1:
        # AveragedModel's first update copies the weights; each later one is ema + (1 - d) * (w - ema).
        expected = w1[name]
        expected = expected + 0.1 * (w2[name] - expected)
        expected = expected + 0.1 * (w3[name] - expected)
        torch.testing.assert_close(ema_params(ema)[name], expected, rtol=1e-6, atol=0)
        assert not torch.equal(expected, w3[name])  # the average really lags the weights
    assert ema.ema_model is not None and int(ema.ema_model.n_averaged) == 3


def test_a_retried_step_is_averaged_once(tmp_path: Path) -> None:
    ema = EmaHook(decay=0.5)
    run = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[ema], script={2: "nan"}, max_non_finite_grad_retries=1)
    run.train()
    assert ema.ema_model is not None and int(ema.ema_model.n_averaged) == 3


def run(workspace: Path, steps: int, **ema_kwargs: Any) -> tuple[TinyTrainer, EmaHook]:
    ema = EmaHook(decay=0.8, **ema_kwargs)
    trainer = TinyTrainer(max_steps=steps, workspace=workspace, hooks=[CheckpointingHook(interval=3), ema])
    trainer.train()
    return trainer, ema


def test_the_average_survives_save_and_resume_bitwise(tmp_path: Path) -> None:
    _, straight = run(tmp_path / "a", 6)
    _, first = run(tmp_path / "b", 3)
    at_save = ema_params(first)
    loaded: dict[str, torch.Tensor] = {}

    class Look(BaseHook):
        def on_before_train(self, trainer: Any) -> None:
            loaded.update(ema_params(resumed_hook))

    resumed_hook = EmaHook(decay=0.8)
    # The EMA hook listed after the checkpoint hook and before the probe: it is built while loading.
    trainer = TinyTrainer(
        max_steps=6, workspace=tmp_path / "b", hooks=[CheckpointingHook(interval=3), resumed_hook, Look()]
    )
    trainer.train()
    assert trainer.attempt == 1
    for name, value in at_save.items():
        assert torch.equal(loaded[name], value)
    for name, value in ema_params(straight).items():
        assert torch.equal(ema_params(resumed_hook)[name], value)
    assert resumed_hook.ema_model is not None and int(resumed_hook.ema_model.n_averaged) == 6


def test_a_checkpoint_without_the_average_starts_it_from_the_loaded_weights(tmp_path: Path) -> None:
    TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[CheckpointingHook(interval=2)]).train()
    ema = EmaHook(decay=0.5)
    copies: list[dict[str, torch.Tensor]] = []

    class Look(BaseHook):
        def on_before_train(self, trainer: Any) -> None:
            copies.append(ema_params(ema))
            copies.append({k: v.detach().clone() for k, v in trainer.model.named_parameters()})

    TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[CheckpointingHook(interval=2), ema, Look()]).train()
    average, model = copies
    assert all(torch.equal(average[k], model[k]) for k in model)


class BatchNormTrainer(TinyTrainer):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(3, 1), nn.BatchNorm1d(1))


@pytest.mark.parametrize("use_buffers", [False, True])
def test_use_buffers_decides_whether_buffers_are_averaged(tmp_path: Path, use_buffers: bool) -> None:
    ema = EmaHook(decay=0.5, use_buffers=use_buffers)
    trainer = BatchNormTrainer(max_steps=3, workspace=tmp_path, hooks=[ema])
    trainer.train()
    assert ema.ema_model is not None and trainer.model is not None
    averaged = ema.ema_model.module[1].running_mean  # type: ignore[index]
    live = trainer.model[1].running_mean  # type: ignore[index]
    assert not torch.equal(live, torch.zeros(1))
    if use_buffers:
        assert not torch.equal(averaged, live)  # averaged: lags the live statistics
    else:
        assert torch.equal(averaged, live)  # copied at every update


class Reference(BaseHook):
    """torch's own ``AveragedModel.update_parameters`` every step, beside the hook's updates."""

    def __init__(self, decay: float, use_buffers: bool) -> None:
        self.decay, self.use_buffers = decay, use_buffers
        self.model: AveragedModel | None = None

    def on_before_train(self, trainer: Any) -> None:
        average = get_ema_multi_avg_fn(self.decay)
        self.model = AveragedModel(trainer.unwrapped_model, multi_avg_fn=average, use_buffers=self.use_buffers)

    def on_after_step(self, trainer: Any) -> None:
        assert self.model is not None
        self.model.update_parameters(trainer.unwrapped_model)


@pytest.mark.parametrize("use_buffers", [False, True])
def test_the_hooks_updates_without_a_host_read_are_torchs_bit_for_bit(tmp_path: Path, use_buffers: bool) -> None:
    """After its first update the hook averages without reading ``n_averaged`` (two syncs per step in
    ``update_parameters``): the same parameters, buffers (BatchNorm's long ``num_batches_tracked``
    too) and count as torch's own update."""
    ema, reference = EmaHook(decay=0.7, use_buffers=use_buffers), Reference(0.7, use_buffers)
    BatchNormTrainer(max_steps=5, workspace=tmp_path, hooks=[ema, reference]).train()
    assert ema.ema_model is not None and reference.model is not None
    ours, torchs = ema.ema_model.state_dict(), reference.model.state_dict()
    assert set(ours) == set(torchs) and "module.1.num_batches_tracked" in ours
    for key, value in torchs.items():
        assert torch.equal(ours[key], value), key
    assert int(ours["n_averaged"]) == 5


def test_two_hooks_keep_their_state_under_their_own_names(tmp_path: Path) -> None:
    hooks = [CheckpointingHook(interval=2), EmaHook(decay=0.5, name="fast"), EmaHook(decay=0.99, name="slow")]
    TinyTrainer(max_steps=2, workspace=tmp_path, hooks=hooks).train()
    hooks_file = torch.load(tmp_path / "checkpoints" / "2" / "hooks.pt", weights_only=True)
    assert set(hooks_file) == {"fast", "slow"}
    assert "n_averaged" in hooks_file["fast"]


def test_the_alias_is_the_same_class() -> None:
    assert EMAHook is EmaHook


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"decay": 1.5}, ValueError, r"decay must be a number in \[0, 1\]"),
        ({"decay": "0.9"}, ValueError, "decay must be a number"),
        ({"decay": True}, ValueError, "decay must be a number"),
        ({"use_buffers": 1}, TypeError, "use_buffers must be True or False"),
        ({"name": ""}, ValueError, "name must be a non-empty str"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        EmaHook(**kwargs)
