"""ValidationHook: when it evaluates, what it logs, and what it must leave untouched (modes, RNG,
exact resume); a signal during an evaluation; the mean over ranks."""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.helpers import TinyTrainer, make_batches, read_events
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.hooks.validation import ValidationHook, _mean_over_ranks

VAL_BATCHES = make_batches(n=3, seed=7)


class Logged(BaseHook):
    """Records every ``trainer.log`` call as (step, records)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, Any]]] = []

    def on_log(self, trainer: Any, records: dict[str, Any], dry_run: bool = False) -> None:
        self.calls.append((trainer.step, records))


def test_evaluates_every_interval_and_at_the_last_step_and_logs_under_val(tmp_path: Path) -> None:
    logged, hook = Logged(), ValidationHook(interval=2, data_loader=VAL_BATCHES)
    trainer = TinyTrainer(max_steps=5, workspace=tmp_path, hooks=[hook, logged])
    trainer.train()
    assert [step for step, _ in logged.calls] == [2, 4, 5]
    assert all(set(records) == {"val"} for _, records in logged.calls)
    assert hook.last == logged.calls[-1][1]["val"] and hook.last_step == 5
    # The last evaluation ran on the final weights: recompute it by hand.
    model = trainer.model
    assert model is not None
    with torch.no_grad():
        losses = [nn.functional.mse_loss(model(b["x"]), b["y"]).item() for b in VAL_BATCHES]
    assert hook.last["loss"] == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert hook.last["m"] == {"batch": 1.0}  # records averaged with key_average: batches 0, 1, 2
    assert isinstance(hook.last["loss"], float)


def test_evaluation_runs_in_eval_mode_without_grad_and_restores_every_submodule(tmp_path: Path) -> None:
    seen: list[tuple[bool, list[bool]]] = []

    def evaluate(trainer: BaseTrainer, data: Any) -> dict[str, Any]:
        assert trainer.model is not None
        seen.append((torch.is_grad_enabled(), [m.training for m in trainer.model.modules()]))
        return {"score": 1.0}

    class Frozen(TinyTrainer):
        def build_model(self) -> nn.Module:
            model = nn.Sequential(super().build_model(), nn.Dropout(0.1))
            model[1].eval()  # a user's frozen submodule: must stay in eval mode
            return model

    modes: list[list[bool]] = []

    class Modes(BaseHook):
        def on_before_step(self, trainer: Any) -> None:
            modes.append([m.training for m in trainer.model.modules()])

    Frozen(max_steps=3, workspace=tmp_path, hooks=[ValidationHook(1, evaluate=evaluate), Modes()]).train()
    assert seen == [(False, [False, False, False])] * 3
    assert modes == [[True, True, False]] * 3


def test_bf16_training_evaluates_under_the_same_autocast(tmp_path: Path) -> None:
    dtypes: list[torch.dtype] = []

    def evaluate(trainer: BaseTrainer, data: Any) -> dict[str, Any]:
        assert trainer.model is not None
        dtypes.append(trainer.model(torch.ones(1, 3)).dtype)
        return {}

    TinyTrainer(
        max_steps=1, mixed_precision="bf16", workspace=tmp_path, hooks=[ValidationHook(1, evaluate=evaluate)]
    ).train()
    assert dtypes == [torch.bfloat16]


class RandomTrainer(BaseTrainer):
    """Dropout, a shuffling loader and Python's random in forward: training draws from every stream."""

    def __init__(self, hooks: list[BaseHook], **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        self.hook_list = hooks

    def build_data_loader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))

    def build_optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None
        return torch.optim.SGD(self.model.parameters(), lr=0.05)

    def build_hooks(self) -> list[BaseHook]:
        return self.hook_list

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        assert self.model is not None
        x, y = input
        return nn.functional.mse_loss(self.model(x), y) + random.random() * 1e-3, {}


def random_evaluate(trainer: BaseTrainer, data: Any) -> dict[str, Any]:
    """Draws from every stream training uses, as a shuffling loader or augmentation would."""
    losses = [trainer.forward(batch)[0] for batch in data]
    return {"loss": torch.stack(losses).mean(), "noise": torch.rand(1).item() + random.random()}


def val_loader() -> Any:
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


def final_params(tmp_path: Path, hooks: list[BaseHook], steps: int = 7) -> list[torch.Tensor]:
    torch.manual_seed(1)
    random.seed(1)
    trainer = RandomTrainer(hooks, max_steps=steps, workspace=tmp_path)
    trainer.train()
    assert trainer.model is not None
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_validation_does_not_change_the_training_run(tmp_path: Path) -> None:
    without = final_params(tmp_path / "a", [])
    hook = ValidationHook(2, evaluate=random_evaluate, build_data_loader=lambda trainer: val_loader())
    with_validation = final_params(tmp_path / "b", [hook])
    assert hook.last_step == 7
    for a, b in zip(without, with_validation, strict=True):
        assert torch.equal(a, b)

    class Unguarded(BaseHook):  # the same draws without restoring the RNG: the run changes
        def wants_stop(self, trainer: Any) -> bool:
            if trainer.step % 2 == 0:
                random_evaluate(trainer, val_loader())
            return False

    disturbed = final_params(tmp_path / "c", [Unguarded()])
    assert not all(torch.equal(a, b) for a, b in zip(without, disturbed, strict=True))


def test_build_data_loader_is_called_once_with_the_trainer(tmp_path: Path) -> None:
    calls: list[Any] = []

    def build(trainer: BaseTrainer) -> list[dict[str, Any]]:
        calls.append(trainer)
        return VAL_BATCHES

    trainer = TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[ValidationHook(1, build_data_loader=build)])
    trainer.train()
    assert calls == [trainer]


def _signal_during_evaluation_at(step: int) -> Any:
    def evaluate(trainer: BaseTrainer, data: Any) -> dict[str, Any]:
        if trainer.step == step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return {"loss": float(trainer.step)}

    return evaluate


def signal_run(workspace: Path, steps: int = 6) -> TinyTrainer:
    hooks = [CheckpointingHook(interval=100), ValidationHook(2, evaluate=_signal_during_evaluation_at(4))]
    trainer = TinyTrainer(max_steps=steps, workspace=workspace, hooks=hooks)
    trainer.set_exit_signals([signal.SIGUSR1])
    return trainer


def test_a_signal_during_validation_checkpoints_at_the_agreed_step_and_exits_138(tmp_path: Path) -> None:
    straight = TinyTrainer(max_steps=6, workspace=tmp_path / "straight")
    straight.train()
    with pytest.raises(SystemExit) as info:
        signal_run(tmp_path / "run").train()
    assert info.value.code == 138
    events = read_events(tmp_path / "run")
    received = [e for e in events if e["event"] == "signal_received"]
    assert [(e["at_step"], e["at_state"]) for e in received] == [(4, "ACCUMULATE")]
    # The trainer reads pending signals after the step's askers (validation runs in one), so the
    # signal is agreed at the end of step 4 itself: checkpoint at 4, exit 138.
    agreed = [e["agreed_step"] for e in events if e["event"] == "signal_agreed"]
    saved = [e["saved_step"] for e in events if e["event"] == "checkpoint_saved"]
    assert agreed == saved == [4]
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["code"]) == ("exit", "preempted", 138)
    resumed = signal_run(tmp_path / "run")  # no signal after step 4 any more
    resumed.train()
    assert resumed.step == 6
    assert straight.model is not None and resumed.model is not None
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_empty_loader_and_a_non_dict_result_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="yielded no batches"):
        TinyTrainer(max_steps=1, workspace=tmp_path / "a", hooks=[ValidationHook(1, data_loader=[])]).train()
    with pytest.raises(TypeError, match="evaluate must return a dict of results; got float"):
        TinyTrainer(max_steps=1, workspace=tmp_path / "b", hooks=[ValidationHook(1, evaluate=lambda t, d: 1.0)]).train()  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"interval": 0, "data_loader": []}, ValueError, "interval must be an int >= 1"),
        ({"interval": True, "data_loader": []}, ValueError, "interval must be an int >= 1"),
        ({"interval": 1}, ValueError, "needs data to evaluate on: pass data_loader=..., build_data_loader=..."),
        ({"interval": 1, "data_loader": [], "build_data_loader": list}, ValueError, "not both"),
        ({"interval": 1, "data_loader": iter([])}, TypeError, "data_loader must be a re-iterable"),
        ({"interval": 1, "data_loader": 3}, TypeError, "data_loader must be a re-iterable"),
        ({"interval": 1, "evaluate": "mean"}, TypeError, "evaluate must be callable or None"),
        ({"interval": 1, "build_data_loader": 3}, TypeError, "build_data_loader must be callable or None"),
        ({"interval": 1, "data_loader": [], "name": ""}, ValueError, "name must be a non-empty str"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ValidationHook(**kwargs)


# ---------------------------------------------------------------- the mean over ranks
def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        results = {"loss": 1.0 + rank, "m": {"acc": 0.5 * rank, "name": "x"}, "hist": torch.ones(2) * rank}
        mean = _mean_over_ranks(results, world, torch.device("cpu"))
        torch.save(mean, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="forks gloo ranks on Linux")
def test_every_number_becomes_the_mean_over_ranks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children need no fresh interpreter (spawn costs ~6 s of imports); never wait forever.
    context = mp.start_processes(
        _rank, args=(2, port, str(tmp_path / "mean")), nprocs=2, join=False, start_method="fork"
    )
    deadline = time.monotonic() + 60
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two gloo ranks did not finish within 60 s")
    for rank in (0, 1):
        mean = torch.load(tmp_path / f"mean.{rank}", weights_only=True)
        assert mean["loss"] == 1.5 and mean["m"] == {"acc": 0.25, "name": "x"}
        assert torch.equal(mean["hist"], torch.ones(2) * rank)  # not a number: left as it was
