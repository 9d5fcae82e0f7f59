"""EarlyStoppingHook: stops through the machine at the exact step, keeps ``best`` on the best
checkpoint through pruning, survives resume; and the checkpoint store's pointers it relies on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer, read_events
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.checkpoint.store import CheckpointStore
from trainfsm.hooks.early_stopping import EarlyStoppingHook
from trainfsm.hooks.validation import ValidationHook

#: Validation loss by step (ValidationHook(interval=2)): improvements at 2 and 4, then none.
LOSSES = {2: 1.0, 4: 0.5, 6: 0.7, 8: 0.6, 10: 0.4, 12: 0.3}


class Scripted:
    """An ``evaluate`` returning ``LOSSES[step]`` (9.0 for other steps); keeps the weights it evaluated."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, trainer: BaseTrainer, data: Any) -> dict[str, Any]:
        assert trainer.model is not None
        self.weights[trainer.step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        return {"loss": LOSSES.get(trainer.step, 9.0)}


def run(
    workspace: Path, max_steps: int = 20, patience: int = 2, **checkpoint_kwargs: Any
) -> tuple[TinyTrainer, EarlyStoppingHook, Scripted]:
    checkpoint_kwargs.setdefault("interval", 3)
    evaluate, stopper = Scripted(), EarlyStoppingHook(monitor="val/loss", patience=patience)
    hooks = [CheckpointingHook(**checkpoint_kwargs), ValidationHook(2, evaluate=evaluate), stopper]
    trainer = TinyTrainer(max_steps=max_steps, workspace=workspace, hooks=hooks)
    trainer.train()
    return trainer, stopper, evaluate


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_stops_at_the_exact_step_through_a_checkpoint_with_reason_stopped(tmp_path: Path) -> None:
    trainer, stopper, _ = run(tmp_path, keep_previous=0)
    assert trainer.step == 8 and trainer.exit_reason == "stopped" and trainer.exit_code == 0
    assert (stopper.best, stopper.best_step, stopper.bad_evaluations) == (0.5, 4, 2)
    events = read_events(tmp_path)
    stop = [e for e in events if e["event"] == "early_stop"]
    assert [(e["step"], e["monitor"], e["best"], e["best_step"], e["patience"]) for e in stop] == [
        (8, "val/loss", 0.5, 4, 2)
    ]
    rows = [(e["trigger"], e["source"], e["dest"], e["step"]) for e in events if e["event"] == "transition"]
    assert rows[-2:] == [("save", "ACCUMULATE", "CHECKPOINT", 8), ("finish", "CHECKPOINT", "EXIT", 8)]
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["code"]) == ("exit", "stopped", 0)
    # Improvements at 2 and 4 asked for checkpoints beside the interval ones (3, 6) and the last (8).
    assert [e["saved_step"] for e in events if e["event"] == "checkpoint_saved"] == [2, 3, 4, 6, 8]


def test_best_points_at_the_evaluated_weights_and_survives_pruning(tmp_path: Path) -> None:
    _, _, evaluate = run(tmp_path, keep_previous=0)
    root = tmp_path / "checkpoints"
    assert names(root) == ["4", "8", "best", "latest"]  # 2, 3 and 6 pruned; 4 kept because best names it
    assert os.readlink(root / "best") == "4" and os.readlink(root / "latest") == "8"
    saved = CheckpointStore.load(root / "4")["model"]["model"]
    assert saved.keys() == evaluate.weights[4].keys()
    assert all(torch.equal(saved[k], evaluate.weights[4][k]) for k in saved)


def test_an_asynchronous_save_moves_best_before_its_prune(tmp_path: Path) -> None:
    run(tmp_path, keep_previous=0, async_save=True)
    root = tmp_path / "checkpoints"
    assert names(root) == ["4", "8", "best", "latest"]
    assert os.readlink(root / "best") == "4"


def test_a_kept_checkpoint_is_named_with_its_suffix(tmp_path: Path) -> None:
    run(tmp_path, keep_previous=0, keep_steps=[4])
    assert os.readlink(tmp_path / "checkpoints" / "best") == "4_keep"


def test_resume_keeps_the_counters_and_the_pointer(tmp_path: Path) -> None:
    first, stopper, _ = run(tmp_path, max_steps=6, keep_previous=0)  # stops by max_steps: one bad evaluation
    assert (first.exit_reason, stopper.best, stopper.best_step, stopper.bad_evaluations) == ("completed", 0.5, 4, 1)
    restored: list[tuple[Any, ...]] = []

    class Look(BaseHook):
        def on_before_train(self, trainer: Any) -> None:
            hook = next(h for h in trainer.hooks if isinstance(h, EarlyStoppingHook))
            restored.append((trainer.step, hook.best, hook.best_step, hook.bad_evaluations))

    evaluate, resumed_stopper = Scripted(), EarlyStoppingHook(monitor="val/loss", patience=2)
    hooks = [CheckpointingHook(interval=3), ValidationHook(2, evaluate=evaluate), resumed_stopper, Look()]
    resumed = TinyTrainer(max_steps=20, workspace=tmp_path, hooks=hooks)
    resumed.train()
    assert restored == [(6, 0.5, 4, 1)]
    # With fresh counters 8 would be a first evaluation (an improvement); with the saved ones it is
    # the second without improvement: stop.
    assert resumed.step == 8 and resumed.exit_reason == "stopped"
    assert os.readlink(tmp_path / "checkpoints" / "best") == "4"
    assert names(tmp_path / "checkpoints") == ["4", "8", "best", "latest"]


def test_resuming_from_the_checkpoint_of_an_improvement_points_best_at_it(tmp_path: Path) -> None:
    run(tmp_path, max_steps=4, keep_previous=0)
    root = tmp_path / "checkpoints"
    (root / "best").unlink()  # as if the process died between the checkpoint's rename and the pointer
    run(tmp_path, max_steps=5, keep_previous=0)
    assert os.readlink(root / "best") == "4"


def test_a_value_logged_after_the_decision_is_checkpointed_at_the_next_step(tmp_path: Path) -> None:
    class LateLogger(BaseHook):
        def on_after_step(self, trainer: Any) -> None:
            if trainer.step == 2:
                trainer.log({"train": {"loss": 0.1}})

    stopper = EarlyStoppingHook(monitor="train/loss")
    hooks = [CheckpointingHook(interval=100), LateLogger(), stopper]
    TinyTrainer(max_steps=5, workspace=tmp_path, hooks=hooks).train()
    saved = [e["saved_step"] for e in read_events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert saved == [3, 5] and stopper.best_step == 2
    assert os.readlink(tmp_path / "checkpoints" / "best") == "3"


def test_without_a_checkpoint_hook_it_only_stops(tmp_path: Path) -> None:
    stopper = EarlyStoppingHook(patience=2)
    hooks = [ValidationHook(2, evaluate=Scripted()), stopper]
    trainer = TinyTrainer(max_steps=20, workspace=tmp_path, hooks=hooks)
    trainer.train()
    assert trainer.step == 8 and trainer.exit_reason == "stopped"
    assert not (tmp_path / "checkpoints").exists()


def test_listed_before_its_validation_hook_it_decides_on_the_same_evaluations(tmp_path: Path) -> None:
    # Every hook's on_evaluate runs before any wants_* is asked, so the list's order does not matter.
    outcomes = []
    for name, order in (("after", 1), ("before", -1)):
        stopper = EarlyStoppingHook(patience=2)
        hooks = [CheckpointingHook(interval=100), ValidationHook(2, evaluate=Scripted()), stopper][::order]
        trainer = TinyTrainer(max_steps=20, workspace=tmp_path / name, hooks=hooks)
        trainer.train()
        best = os.readlink(tmp_path / name / "checkpoints" / "best")
        outcomes.append((trainer.step, trainer.exit_reason, stopper.best_step, best))
    assert outcomes[0] == outcomes[1] and outcomes[0][1] == "stopped"


def test_improvement_rules_mode_min_delta_and_non_finite_values() -> None:
    trainer = TinyTrainer(max_steps=1)
    higher = EarlyStoppingHook(monitor="val/acc", mode="max", min_delta=0.1)
    assert [higher.update(v, step) for step, v in enumerate([0.5, 0.55, 0.61, float("nan"), float("inf"), 0.7])] == [
        True,
        False,
        True,
        False,
        False,
        False,
    ]
    assert (higher.best, higher.best_step, higher.bad_evaluations) == (0.61, 2, 3)
    lower = EarlyStoppingHook(monitor="val/loss")
    lower.on_log(trainer, {"val": {"loss": torch.tensor(2.0)}})
    lower.on_log(trainer, {"val/loss": 1.0})  # a flat key works too
    lower.on_log(trainer, {"val": {"acc": 1.0}, "loss": 0.0})  # not the monitored value: no evaluation
    lower.on_log(trainer, {"val": {"loss": 0.5}}, dry_run=True)  # intent only: not counted
    assert (lower.best, lower.bad_evaluations) == (1.0, 0)
    lower.on_log(trainer, {"val": {"loss": 1.0}})
    assert lower.bad_evaluations == 1  # equal is no improvement
    with pytest.raises(TypeError, match="monitor 'val/loss' must be logged as a number"):
        lower.on_log(trainer, {"val": {"loss": "low"}})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"monitor": ""}, "monitor must name a logged value"),
        ({"monitor": "val//loss"}, "monitor must name a logged value"),
        ({"mode": "lowest"}, r"mode must be one of \('min', 'max'\)"),
        ({"patience": 0}, "patience must be an int >= 1"),
        ({"patience": 2.5}, "patience must be an int >= 1"),
        ({"min_delta": -0.1}, "min_delta must be a finite number >= 0"),
        ({"min_delta": float("nan")}, "min_delta must be a finite number >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EarlyStoppingHook(**kwargs)


# ---------------------------------------------------------------- the store's pointers
def save(store: CheckpointStore, step: int, keep: bool = False) -> None:
    store.save(step, {"model": {"w": torch.full((1,), float(step))}}, keep=keep)


def test_point_makes_an_atomic_pointer_that_prune_never_deletes(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3, 4):
        save(store, step)
    store.point("best", "2")
    assert store.target("best") == "2" and store.pointers() == {"latest": "4", "best": "2"}
    assert [c.step for c in store.prune(keep_previous=0)] == [1, 3]
    assert names(tmp_path) == ["2", "4", "best", "latest"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_plain_file_pointer_protects_its_target_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*_: Any, **__: Any) -> None:
        raise OSError("symlinks not supported")

    monkeypatch.setattr(Path, "symlink_to", no_links)
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        save(store, step)
    store.point("best", "1")
    assert (tmp_path / "best").read_text() == "1\n"
    store.prune(keep_previous=0)
    assert names(tmp_path) == ["1", "3", "best", "latest"]


def test_files_that_are_not_pointers_are_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    save(store, 1)
    (tmp_path / "notes.bin").write_bytes(b"\xff\xfe" * 10)
    (tmp_path / "big.txt").write_text("1\n" * 5000)
    assert store.pointers() == {"latest": "1"}


def test_point_when_saved_moves_with_the_first_save_at_or_after_the_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.point_when_saved("best", 3)
    save(store, 2)
    assert store.target("best") is None
    save(store, 3)
    save(store, 4)
    assert store.target("best") == "3"
    store.point_when_saved("best", 5)
    save(store, 6, keep=True)
    assert store.target("best") == "6_keep"


@pytest.mark.parametrize("pointer", ["", "3", "3_keep", ".hidden", "a/b", "manifest.json"])
def test_a_pointer_name_that_could_be_a_checkpoint_or_a_temporary_is_refused(tmp_path: Path, pointer: str) -> None:
    with pytest.raises(ValueError, match="pointer name must be a plain file name"):
        CheckpointStore(tmp_path).point(pointer, "1")
