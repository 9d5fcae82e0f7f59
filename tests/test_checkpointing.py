"""CheckpointingHook and CheckpointStore: layout on disk, atomicity, verified loading, exact resume."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import signal
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch import nn

from tests.helpers import read_events, trail_events
from tests.tiers import DEVICES
from trainfsm import BaseHook, BaseTrainer, CheckpointError, CheckpointingHook
from trainfsm.checkpoint.io import BUFFER_BYTES, FROM_CALLER_BYTES, DurableWriter, Staging, open_for_writing
from trainfsm.checkpoint.store import CheckpointStore


class Trainer(BaseTrainer):
    """Dropout, a shuffling DataLoader, Adam and a StepLR: everything exact resume must restore. On
    ``device="cuda"`` (the GPU tier) the model and each batch move there: dropout draws from CUDA's
    generator, and a save copies the state from GPU memory."""

    def __init__(self, hook: CheckpointingHook | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        self.hook = hook

    def build_data_loader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1)).to(self.device)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=0.05)  # type: ignore[union-attr]

    def build_lr_scheduler(self) -> Any:
        return torch.optim.lr_scheduler.StepLR(self.optimizer, 3)  # type: ignore[arg-type]

    def build_hooks(self) -> list[Any]:
        return [self.hook] if self.hook else []

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = (t.to(self.device) for t in input)
        noise = random.random() * 1e-3  # python's RNG must be restored too
        return nn.functional.mse_loss(self.model(x), y) + noise, {}  # type: ignore[misc]


def params(trainer: BaseTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]  # type: ignore[union-attr]


def events(workspace: Path, name: str | None = None) -> list[dict[str, Any]]:
    out = trail_events(workspace)
    return [e for e in out if name is None or e["event"] == name]


def run(workspace: Path, steps: int, device: str = "cpu", **hook_kwargs: Any) -> Trainer:
    hook_kwargs.setdefault("interval", 4)
    trainer = Trainer(CheckpointingHook(**hook_kwargs), max_steps=steps, workspace=workspace, device=device)
    torch.manual_seed(1)
    random.seed(1)
    trainer.train()
    return trainer


def test_layout_one_directory_per_step_with_manifest_and_latest_link(tmp_path: Path) -> None:
    run(tmp_path, 8)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["8", "latest"]
    assert sorted(p.name for p in (root / "8").iterdir()) == ["manifest.json", "model.pt", "training_state.pt"]
    assert (root / "latest").is_symlink() and os.readlink(root / "latest") == "8"
    manifest = json.loads((root / "8" / "manifest.json").read_text())
    assert manifest["step"] == 8 and manifest["format"] == 5
    assert manifest["checksum"] == "xxh3_128"  # the default, named in the manifest
    assert set(manifest["versions"]) == {"trainfsm", "torch", "python"}
    for name, entry in manifest["files"].items():
        assert (root / "8" / name).stat().st_size == entry["bytes"]
        assert set(entry) == {"bytes", "digest"} and len(entry["digest"]) == 32  # one 128-bit sum a file


def test_saves_at_interval_keep_steps_and_last_step_then_prunes(tmp_path: Path) -> None:
    run(tmp_path, 11, interval=4, keep_previous=1, keep_steps=[6], keep_interval=10)
    saved = [e["step"] for e in events(tmp_path, "checkpoint_saved")]
    assert saved == [4, 6, 8, 10, 11]
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["10_keep", "11", "6_keep", "8", "latest"]
    pruned = [p for e in events(tmp_path, "checkpoint_pruned") for p in e["paths"]]
    assert pruned == [str(root / "4")]


def test_transitions_go_through_checkpoint_state(tmp_path: Path) -> None:
    run(tmp_path, 5, interval=4)
    rows = [(e["trigger"], e["source"], e["dest"], e["step"]) for e in events(tmp_path, "transition")]
    assert ("save", "ACCUMULATE", "CHECKPOINT", 4) in rows
    assert ("resume", "CHECKPOINT", "STEP", 4) in rows
    assert rows[-2:] == [("save", "ACCUMULATE", "CHECKPOINT", 5), ("finish", "CHECKPOINT", "EXIT", 5)]


@pytest.mark.parametrize("device", DEVICES)
def test_resume_is_exact_with_dropout_shuffle_adam_and_scheduler(tmp_path: Path, device: str) -> None:
    straight = params(run(tmp_path / "a", 13, device))
    run(tmp_path / "b", 7, device)  # interrupted mid-epoch (5 batches per epoch), checkpoint at step 7
    torch.manual_seed(999)  # a different process state (CUDA's generator too): all must come from the checkpoint
    random.seed(999)
    resumed = Trainer(CheckpointingHook(interval=4), max_steps=13, workspace=tmp_path / "b", device=device)
    resumed.train()
    assert resumed.attempt == 1
    assert [e["path"] for e in events(tmp_path / "b", "checkpoint_loaded")] == [str(tmp_path / "b/checkpoints/7")]
    for a, b in zip(straight, params(resumed), strict=True):
        assert torch.equal(a, b)
    assert resumed.lr_scheduler.last_epoch == 13  # type: ignore[union-attr]


def test_checkpoints_written_past_the_page_cache_resume_the_same(tmp_path: Path) -> None:
    direct = run(tmp_path / "a", 8, direct_io=True)
    cached = run(tmp_path / "b", 8, direct_io=False)
    assert cached.hook is not None and cached.hook.store is not None and cached.hook.store.direct_io is False
    a = CheckpointStore.load(tmp_path / "a" / "checkpoints" / "8")["model"]["model"]
    b = CheckpointStore.load(tmp_path / "b" / "checkpoints" / "8")["model"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(params(direct), params(cached), strict=True))
    supported = _direct_io_works(tmp_path)
    assert [e["direct_io"] for e in events(tmp_path / "a", "checkpoint_saved")] == [supported, supported]
    assert [e["direct_io"] for e in events(tmp_path / "b", "checkpoint_saved")] == [False, False]


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda root: CheckpointingHook(interval=1, direct_io="yes"), "CheckpointingHook"),
        (lambda root: CheckpointStore(root, direct_io="yes"), "CheckpointStore"),
    ],
)
def test_direct_io_must_be_true_false_or_auto(tmp_path: Path, make: Any, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} direct_io must be True .*, False .* or 'auto' .*; got 'yes'.$"):
        make(tmp_path)


def test_resume_of_a_finished_run_exits_without_stepping(tmp_path: Path) -> None:
    run(tmp_path, 4)
    again = Trainer(CheckpointingHook(interval=4), max_steps=4, workspace=tmp_path)
    again.train()
    last = events(tmp_path)
    attempt1 = [e for e in last if e["attempt"] == 1]
    assert [(e["trigger"], e["dest"]) for e in attempt1 if e["event"] == "transition"] == [
        ("built", "RESTORE"),
        ("finish", "EXIT"),
    ]
    assert attempt1[-1]["event"] == "exit" and attempt1[-1]["reason"] == "completed"


def test_latest_skips_a_corrupt_newest_checkpoint_with_a_warning(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    model_file = tmp_path / "checkpoints" / "8" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:-10] + b"0123456789")  # same size, other bytes
    resumed = Trainer(CheckpointingHook(interval=4), max_steps=9, workspace=tmp_path)
    resumed.train()
    skipped = events(tmp_path, "checkpoint_skipped")
    assert [e["path"] for e in skipped] == [str(tmp_path / "checkpoints" / "8")]
    assert "does not match its xxh3_128" in skipped[0]["reason"]
    assert events(tmp_path, "checkpoint_loaded")[0]["path"] == str(tmp_path / "checkpoints" / "4")


def test_latest_skips_a_checkpoint_without_manifest(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    (tmp_path / "checkpoints" / "8" / "manifest.json").unlink()
    resumed = Trainer(CheckpointingHook(interval=4), max_steps=7, workspace=tmp_path)
    resumed.train()
    assert "whose manifest.json is missing" in events(tmp_path, "checkpoint_skipped")[0]["reason"]
    assert events(tmp_path, "checkpoint_loaded")[0]["from_step"] == 4


def test_a_checkpoint_without_manifest_is_not_saved_over(tmp_path: Path) -> None:
    """Without its manifest, nothing proves trainfsm wrote the directory: a run that would save
    step 8 again stops in RESTORE instead of replacing it."""
    run(tmp_path, 8, keep_previous=1)
    (tmp_path / "checkpoints" / "8" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="checkpoints/8 was written by trainloop"):
        Trainer(CheckpointingHook(interval=4), max_steps=9, workspace=tmp_path).train()
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "8").iterdir()) == ["model.pt", "training_state.pt"]


def test_a_named_checkpoint_older_than_the_newest_is_warned_about(tmp_path: Path, capsys: Any) -> None:
    run(tmp_path, 8, keep_previous=1)
    Trainer(CheckpointingHook(interval=4, load="4"), max_steps=6, workspace=tmp_path).train()
    (warning,) = events(tmp_path, "checkpoint_not_newest")
    root = tmp_path / "checkpoints"
    assert (warning["path"], warning["from_step"]) == (str(root / "4"), 4)
    assert (warning["newest"], warning["newest_step"]) == (str(root / "8"), 8)
    console = capsys.readouterr().err
    assert "(step 8) is newer: the 4 steps since are trained again" in console
    assert 'A script that is requeued after a preemption should resume with load="latest"' in console


def test_loading_the_newest_by_name_warns_nothing(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    Trainer(CheckpointingHook(interval=4, load="8"), max_steps=10, workspace=tmp_path).train()
    assert events(tmp_path, "checkpoint_not_newest") == []


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "model.pt").unlink(), "model.pt is missing"),
        (lambda d: (d / "model.pt").write_bytes(b"short"), "has 5 bytes"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "not valid JSON"),
    ],
)
def test_explicit_load_of_a_damaged_checkpoint_is_a_clear_error(tmp_path: Path, damage: Any, message: str) -> None:
    run(tmp_path, 4)
    damage(tmp_path / "checkpoints" / "4")
    trainer = Trainer(CheckpointingHook(interval=4, load="4"), max_steps=6, workspace=tmp_path)
    with pytest.raises(CheckpointError, match=message):
        trainer.train()
    assert events(tmp_path)[-1]["event"] == "exit" and events(tmp_path)[-1]["reason"] == "failed"


def test_explicit_load_of_a_missing_path_names_it(tmp_path: Path) -> None:
    trainer = Trainer(CheckpointingHook(interval=4, load=tmp_path / "nope"), max_steps=2, workspace=tmp_path)
    with pytest.raises(CheckpointError, match="nope does not exist"):
        trainer.train()


class _Payload:
    """Unpickling this creates a file: proof that code from the checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def test_a_malicious_pickle_is_refused_and_runs_no_code(tmp_path: Path) -> None:
    run(tmp_path, 4)
    directory = tmp_path / "checkpoints" / "4"
    marker = tmp_path / "pwned"
    torch.save({"model": _Payload(str(marker))}, directory / "model.pt")  # a real torch file
    evil = (directory / "model.pt").read_bytes()
    assert not marker.exists()
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["model.pt"] = {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(manifest))  # an attacker can fix the manifest too
    with pytest.raises(CheckpointError, match="weights_only=True"):
        CheckpointStore.load(directory)
    assert not marker.exists()
    torch.load(directory / "model.pt", weights_only=False)  # the payload is real: unsafe loading runs it
    assert marker.exists()


def test_a_plain_pickle_file_is_refused(tmp_path: Path) -> None:
    run(tmp_path, 4)
    directory = tmp_path / "checkpoints" / "4"
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(str(marker)), protocol=2)
    (directory / "model.pt").write_bytes(evil)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["model.pt"] = {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="weights_only=True"):
        CheckpointStore.load(directory)
    assert not marker.exists()


def test_leftover_temporary_directory_is_removed_with_an_event(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / ".tmp-4-deadbeef").mkdir(parents=True)
    (root / ".tmp-4-deadbeef" / "model.pt").write_bytes(b"partial")
    run(tmp_path, 4)
    assert not (root / ".tmp-4-deadbeef").exists()
    assert events(tmp_path, "checkpoint_tmp_removed")[0]["names"] == [".tmp-4-deadbeef"]
    assert (root / "latest").resolve() == (root / "4").resolve()


def test_a_checkpoint_moved_aside_by_an_interrupted_resave_is_restored(tmp_path: Path) -> None:
    run(tmp_path, 4)
    root = tmp_path / "checkpoints"
    (root / "4").rename(root / ".tmp-old-4-cafebabe")  # the save died right after moving it aside
    store = CheckpointStore(root)
    store.remove_leftovers()
    assert (root / "4" / "manifest.json").is_file()
    CheckpointStore.verify(root / "4")


def test_a_save_killed_between_its_manifest_and_its_rename_is_put_in_place(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    root = tmp_path / "checkpoints"
    (root / "8").rename(root / ".tmp-8-cafebabe")  # complete, only its rename (and latest's move) missing
    (root / "latest").unlink()
    (root / "latest").symlink_to("4")
    _resume(tmp_path)
    assert events(tmp_path, "checkpoint_tmp_completed")[0]["names"] == ["8"]
    assert events(tmp_path, "checkpoint_loaded")[0]["from_step"] == 8


def test_a_resave_whose_rename_fails_puts_the_old_copy_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)
    store.save(5, {"model": {"w": torch.zeros(1)}}, keep=False)
    rename = Path.rename

    def failing(self: Path, target: Any) -> Path:
        if self.name.startswith(".tmp-5-"):
            raise OSError(5, "Input/output error")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="Input/output error"):
        store.save(5, {"model": {"w": torch.ones(1)}}, keep=False)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "latest"]
    assert torch.equal(CheckpointStore.load(tmp_path / "5")["model"]["w"], torch.zeros(1))


def test_pruning_never_removes_newest_or_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step, keep in [(1, True), (2, False), (3, False), (4, False)]:
        store.save(step, {"model": {"w": torch.zeros(1)}}, keep=keep)
    store.prune(keep_previous=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1_keep", "4", "latest"]


def test_latest_falls_back_to_a_plain_file_where_links_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*_: Any, **__: Any) -> None:
        raise OSError("symlinks not supported")

    monkeypatch.setattr(Path, "symlink_to", no_links)
    store = CheckpointStore(tmp_path)
    store.save(3, {"model": {"w": torch.ones(1)}}, keep=False)
    assert (tmp_path / "latest").read_text() == "3\n"
    assert [c.step for c in store.candidates()] == [3]


def test_relative_path_without_workspace_is_a_clear_error() -> None:
    trainer = Trainer(CheckpointingHook(interval=1), max_steps=1)
    with pytest.raises(ValueError, match="relative and the trainer has no workspace"):
        trainer.train()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 0}, "interval must be an int >= 1"),
        ({"interval": 1, "keep_previous": -1}, "keep_previous must be an int >= 0"),
        ({"interval": 1, "keep_steps": [0]}, "keep_steps must be an int >= 1"),
        ({"interval": 1, "exit_code": 300}, "exit_code must be '128\\+signal' or an int in 0..255"),
        ({"interval": 1, "exit_wait": -1}, "exit_wait must be seconds >= 0"),
        ({"interval": 1, "exit_signals": ["TERM"]}, "exit_signals must be signal.Signals"),
        ({"interval": 1, "data_resume": "rewind"}, "data_resume must be one of"),
    ],
)
def test_bad_hook_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        CheckpointingHook(**kwargs)


def test_exit_signal_arguments_are_accepted_and_normalised() -> None:
    hook = CheckpointingHook(interval=1, exit_signals=[signal.SIGTERM, 10], exit_code=0, exit_wait=1.5)
    assert hook.exit_signals == (signal.SIGTERM, signal.SIGUSR1)
    assert (hook.exit_code, hook.exit_wait) == (0, 1.5)


class WiderTrainer(Trainer):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 9), nn.Dropout(0.3), nn.Linear(9, 1), nn.Linear(1, 1))


def test_resume_with_a_changed_model_names_every_mismatched_key(tmp_path: Path) -> None:
    run(tmp_path, 4)
    trainer = WiderTrainer(CheckpointingHook(interval=4), max_steps=6, workspace=tmp_path)
    with pytest.raises(CheckpointError) as info:
        trainer.train()
    message = str(info.value)
    assert "missing keys: 3.bias, 3.weight" in message
    assert "shape mismatch: 0.bias (checkpoint (8,), model (9,)), 0.weight (checkpoint (8, 4), model (9, 4))" in message
    assert "2.weight (checkpoint (1, 8), model (1, 9))" in message


@pytest.mark.parametrize("device", DEVICES)
def test_async_save_writes_the_same_checkpoints_and_reports_blocked_time(tmp_path: Path, device: str) -> None:
    sync = run(tmp_path / "sync", 9, device)
    asynchronous = run(tmp_path / "async", 9, device, async_save=True)
    for a, b in zip(params(sync), params(asynchronous), strict=True):
        assert torch.equal(a, b)
    saved = events(tmp_path / "async", "checkpoint_saved")
    assert [e["saved_step"] for e in saved] == [4, 8, 9]
    assert all(e["asynchronous"] and e["blocked_seconds"] >= 0 for e in saved)
    for step in (9,):
        a = CheckpointStore.load(tmp_path / "sync" / "checkpoints" / str(step))["model"]["model"]
        b = CheckpointStore.load(tmp_path / "async" / "checkpoints" / str(step))["model"]["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert os.readlink(tmp_path / "async" / "checkpoints" / "latest") == "9"  # EXIT waited for it


@pytest.mark.parametrize("device", DEVICES)
def test_async_save_stages_a_copy_so_later_steps_do_not_leak_into_it(tmp_path: Path, device: str) -> None:
    run(tmp_path / "sync", 4, device, interval=2, keep_previous=5)
    run(tmp_path / "async", 4, device, interval=2, keep_previous=5, async_save=True)
    a = CheckpointStore.load(tmp_path / "sync" / "checkpoints" / "2")["model"]["model"]
    b = CheckpointStore.load(tmp_path / "async" / "checkpoints" / "2")["model"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def _disk_full(*_: Any, **__: Any) -> None:
    raise OSError(28, "No space left on device")


def test_a_failed_save_loses_no_earlier_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(tmp_path, 4)
    monkeypatch.setattr("trainfsm.checkpoint.io.DurableWriter.write", _disk_full)
    trainer = Trainer(CheckpointingHook(interval=4), max_steps=8, workspace=tmp_path)
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["4", "latest"]  # no partial 8, no temp dir
    CheckpointStore.verify(root / "4")
    assert events(tmp_path)[-1]["reason"] == "failed"


def test_a_failed_async_save_raises_at_the_next_step_or_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainfsm.checkpoint.io.DurableWriter.write", _disk_full)
    trainer = Trainer(CheckpointingHook(interval=4, async_save=True), max_steps=8, workspace=tmp_path)
    with pytest.raises(CheckpointError, match="asynchronous checkpoint save failed: OSError"):
        trainer.train()
    failed = events(tmp_path, "checkpoint_failed")
    assert len(failed) == 1 and "No space left" in failed[0]["message"]
    assert 4 < failed[0]["step"] <= 8
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name != "latest"]


def test_a_path_already_under_a_relative_workspace_is_not_nested_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    workspace = Path("runs") / "exp"
    trainer = Trainer(CheckpointingHook(interval=2, path=workspace / "checkpoints"), max_steps=2, workspace=workspace)
    trainer.train()
    assert (tmp_path / "runs" / "exp" / "checkpoints" / "2" / "manifest.json").is_file()
    assert not (tmp_path / "runs" / "exp" / "runs").exists()


def _resume(tmp_path: Path, steps: int = 9) -> Trainer:
    trainer = Trainer(CheckpointingHook(interval=4), max_steps=steps, workspace=tmp_path)
    trainer.train()
    return trainer


def test_a_manifest_copied_from_another_checkpoint_is_rejected(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    root = tmp_path / "checkpoints"
    (root / "8" / "manifest.json").write_bytes((root / "4" / "manifest.json").read_bytes())
    _resume(tmp_path)
    assert "describes step 4, not 8" in events(tmp_path, "checkpoint_skipped")[0]["reason"]
    assert events(tmp_path, "checkpoint_loaded")[0]["from_step"] == 4


def test_a_newer_complete_checkpoint_wins_over_a_stale_latest(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    root = tmp_path / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to("4")  # the save of 8 died after its rename, before latest moved
    _resume(tmp_path)
    assert events(tmp_path, "checkpoint_loaded")[0]["from_step"] == 8


def _roll_back(tmp_path: Path, **hook_kwargs: Any) -> None:
    """A run saves steps 2, 4, 6 and 8; a second one resumes from 4 (``load="4"``) and saves step 7."""
    run(tmp_path, 8, interval=2, keep_previous=3, **hook_kwargs)
    hook = CheckpointingHook(interval=4, keep_previous=3, load="4", **hook_kwargs)
    Trainer(hook, max_steps=7, workspace=tmp_path).train()


def test_after_a_rollback_latest_resumes_the_rolled_back_run_not_the_abandoned_newer_step(tmp_path: Path) -> None:
    _roll_back(tmp_path, keep_steps=[8])  # kept: still on disk after the rollback's prune
    assert (tmp_path / "checkpoints" / "8_keep").is_dir()
    _resume(tmp_path)
    assert [e["from_step"] for e in events(tmp_path, "checkpoint_loaded")] == [4, 7]


def test_a_rollback_killed_before_latest_moved_still_resumes_the_rolled_back_run(tmp_path: Path) -> None:
    _roll_back(tmp_path, keep_steps=[8])
    root = tmp_path / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to("8_keep")  # the save of 7 died after its rename, before latest moved
    _resume(tmp_path)
    assert events(tmp_path, "checkpoint_loaded")[-1]["from_step"] == 7


def test_a_rollbacks_saves_never_prune_the_run_it_abandoned_and_keep_previous_counts_its_own_timeline(
    tmp_path: Path,
) -> None:
    run(tmp_path, 8, interval=2, keep_previous=3)  # 2, 4, 6, 8
    Trainer(CheckpointingHook(interval=4, keep_previous=1, load="4"), max_steps=7, workspace=tmp_path).train()
    root = tmp_path / "checkpoints"
    # 7 and 4 are the rollback's newest two; 6 and 8 are the abandoned run's trained work: kept
    assert sorted(p.name for p in root.iterdir()) == ["4", "6", "7", "8", "latest"]
    assert events(tmp_path, "checkpoint_pruned")[-1]["paths"] == [str(root / "2")]


def test_a_fine_tune_from_best_in_the_same_directory_deletes_none_of_the_main_runs_checkpoints(
    tmp_path: Path,
) -> None:
    run(tmp_path, 8, interval=2, keep_previous=1)  # 6, 8
    CheckpointStore(tmp_path / "checkpoints").point("best", "6")
    Trainer(CheckpointingHook(interval=1, keep_previous=1, load="best"), max_steps=7, workspace=tmp_path).train()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["6", "7", "8", "best", "latest"]


def test_an_unkept_save_of_a_step_leaves_a_kept_copy_of_it_and_latest_takes_the_new_one(tmp_path: Path) -> None:
    run(tmp_path, 8, interval=2, keep_previous=1, keep_steps=[8])  # 6, 8_keep
    root = tmp_path / "checkpoints"
    pinned = (root / "8_keep" / "manifest.json").read_bytes()
    Trainer(CheckpointingHook(interval=2, keep_previous=1, load="6"), max_steps=8, workspace=tmp_path).train()
    assert (root / "8_keep" / "manifest.json").read_bytes() == pinned  # the abandoned run's pinned step, intact
    assert (root / "8").is_dir()
    _resume(tmp_path)
    assert events(tmp_path, "checkpoint_loaded")[-1]["path"] == str(root / "8")


def test_a_fresh_start_abandons_the_checkpoints_already_there_at_its_first_save_and_keeps_them(
    tmp_path: Path, capsys: Any
) -> None:
    run(tmp_path, 8, keep_previous=1)
    Trainer(CheckpointingHook(interval=2, keep_previous=1, load=None), max_steps=2, workspace=tmp_path).train()
    assert "holds checkpoints up to step 8: once this run saves, they are abandoned" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4", "8", "latest"]
    _resume(tmp_path, steps=2)
    assert events(tmp_path, "checkpoint_loaded")[0]["from_step"] == 2


def test_a_rollback_abandons_checkpoints_an_earlier_version_wrote_without_their_order(tmp_path: Path) -> None:
    run(tmp_path, 8, interval=2, keep_previous=3)  # 2, 4, 6, 8
    for manifest in (tmp_path / "checkpoints").glob("*/manifest.json"):  # as trainfsm wrote them before
        fields = json.loads(manifest.read_text())
        fields.pop("sequence", None), fields.pop("resumed", None)  # latest/ is 8/ again
        manifest.write_text(json.dumps(fields))
    Trainer(CheckpointingHook(interval=3, keep_previous=3, load="4"), max_steps=7, workspace=tmp_path).train()
    _resume(tmp_path)
    assert [e["from_step"] for e in events(tmp_path, "checkpoint_loaded")] == [4, 7]


def test_a_newer_checkpoint_that_failed_to_read_once_is_not_abandoned(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    model = tmp_path / "checkpoints" / "8" / "model.pt"
    model.rename(model.with_suffix(".away"))  # a read that fails at this start only (a flaky file system)
    Trainer(CheckpointingHook(interval=4, keep_previous=1), max_steps=6, workspace=tmp_path).train()
    model.with_suffix(".away").rename(model)
    _resume(tmp_path)
    assert [e["from_step"] for e in events(tmp_path, "checkpoint_loaded")] == [4, 8]


def test_a_step_named_directory_of_junk_is_reported_once_not_tried(tmp_path: Path) -> None:
    run(tmp_path, 4)
    junk = tmp_path / "checkpoints" / "100"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a checkpoint")
    _resume(tmp_path)
    assert events(tmp_path, "checkpoint_skipped") == []
    assert [e["found"] for e in events(tmp_path, "checkpoint_foreign")] == [{"100": "unknown"}]
    assert events(tmp_path, "checkpoint_loaded")[0]["from_step"] == 4


def test_a_latest_link_to_a_missing_directory_falls_back_to_the_newest_complete(tmp_path: Path) -> None:
    run(tmp_path, 8, keep_previous=1)
    root = tmp_path / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to("12")
    _resume(tmp_path)
    assert events(tmp_path, "checkpoint_loaded")[0]["from_step"] == 8


def test_an_unwritable_checkpoint_directory_fails_the_save_and_keeps_the_old_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, 4)

    mkdir = Path.mkdir

    def read_only(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.parent.name == "checkpoints":  # as root, chmod would not stop us
            raise PermissionError(13, "Permission denied", str(self))
        mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(PermissionError):
        _resume(tmp_path, steps=8)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "latest"]
    CheckpointStore.verify(tmp_path / "checkpoints" / "4")
    assert events(tmp_path)[-1]["reason"] == "failed"


OLD_CHUNK = 4 << 20  # formats 2-4 listed a sum per 4 MiB


def file_sum(data: bytes, checksum: str = "xxh3_128") -> str:
    return (hashlib.sha256 if checksum == "sha256" else xxhash.xxh3_128)(data).hexdigest()


def chunk_sums(data: bytes, checksum: str) -> list[str]:
    return [file_sum(data[i : i + OLD_CHUNK], checksum) for i in range(0, max(len(data), 1), OLD_CHUNK)]


@pytest.mark.parametrize("megabytes", [0, 9])
def test_manifest_checksums_are_the_xxh3_128_of_the_files_on_disk(tmp_path: Path, megabytes: int) -> None:
    # Large tensors cross the staging buffers' boundaries (4 x 9 MiB); small writes share a buffer.
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(megabytes * 2**18 + 17, generator=generator) for i in range(4)}
    state["small"] = torch.arange(10)
    checkpoint, _, _ = CheckpointStore(tmp_path).save(1, {"model": state, "training_state": {"step": 1}}, keep=False)
    manifest = json.loads((checkpoint.path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (checkpoint.path / name).read_bytes()
        assert entry == {"bytes": len(data), "digest": file_sum(data)}
    loaded = CheckpointStore.load(checkpoint.path)["model"]
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def write_file(path: Path, pieces: list[Any], direct: bool = True) -> tuple[dict[str, Any], bool]:
    """The manifest entry DurableWriter gives a file written in ``pieces``, and whether it
    still wrote past the page cache at the end."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as io:
        writer = DurableWriter(path, io, Staging(), direct=direct)
        for piece in pieces:
            writer.write(piece)
        entry = writer.finish()
        return entry, writer._direct


def test_a_file_of_exactly_one_buffer_has_the_sum_of_its_bytes(tmp_path: Path) -> None:
    data = bytes(range(256)) * (BUFFER_BYTES // 256)
    entry, _ = write_file(tmp_path / "f", [data[:100], data[100:]])
    assert entry == {"bytes": len(data), "digest": file_sum(data)}
    assert (tmp_path / "f").read_bytes() == data


def test_an_empty_file_has_the_sum_of_no_bytes(tmp_path: Path) -> None:
    entry, _ = write_file(tmp_path / "f", [])
    assert entry == {"bytes": 0, "digest": file_sum(b"")}
    assert (tmp_path / "f").read_bytes() == b""


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "page cache"])
def test_a_buffer_reused_after_write_returned_does_not_change_the_file(tmp_path: Path, direct: bool) -> None:
    # Device tensors reach write() as temporary host buffers that torch frees or reuses afterwards;
    # through the page cache a large one is written from torch's memory, before write() returns.
    from concurrent.futures import ThreadPoolExecutor

    buffer = bytearray(b"a" * (20 << 20))
    with ThreadPoolExecutor(1) as io:
        writer = DurableWriter(tmp_path / "f", io, Staging(), direct=direct)
        writer.write(b"header")
        writer.write(buffer)
        buffer[:] = b"b" * len(buffer)  # what a reused buffer looks like after write() returned
        writer.write(buffer)
        entry = writer.finish()
    data = (tmp_path / "f").read_bytes()
    assert data == b"header" + b"a" * (20 << 20) + b"b" * (20 << 20)
    assert entry == {"bytes": len(data), "digest": file_sum(data)}


def test_torch_runs_ahead_of_the_disk_by_all_but_one_staging_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # How far serialization may run ahead of the disk is what made saves as fast as the disk alone
    # (issue 14's measurements): with the disk stalled, write() still takes BUFFERS - 1 full buffers
    # (one is being written), and only the next one waits for the disk.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from trainfsm.checkpoint.io import BUFFERS

    disk = threading.Event()
    pwrite = os.pwrite

    def stalled(fd: int, data: Any, offset: int) -> int:
        disk.wait()
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", stalled)
    data = os.urandom((BUFFERS + 1) * BUFFER_BYTES)
    piece = FROM_CALLER_BYTES // 2  # small writes (a pickle, zip headers) are the ones staged

    def write(part: bytes) -> None:
        for start in range(0, len(part), piece):
            writer.write(part[start : start + piece])

    with ThreadPoolExecutor(1) as io:
        writer = DurableWriter(tmp_path / "f", io, Staging(), direct=False)
        try:
            ahead = threading.Thread(target=write, args=(data[: (BUFFERS - 1) * BUFFER_BYTES],))
            ahead.start()
            ahead.join(timeout=10)
            assert not ahead.is_alive()  # BUFFERS - 1 buffers taken while the disk has written nothing
            more = threading.Thread(target=write, args=(data[(BUFFERS - 1) * BUFFER_BYTES :],))
            more.start()
            more.join(timeout=0.5)
            assert more.is_alive()  # the next full buffer waits for the disk
        finally:
            disk.set()  # a failed check must not leave the I/O thread stalled
        more.join(timeout=30)
        entry = writer.finish()
    assert (tmp_path / "f").read_bytes() == data and entry == {"bytes": len(data), "digest": file_sum(data)}


def test_through_the_page_cache_a_tensor_goes_to_the_kernel_from_torchs_memory(tmp_path: Path) -> None:
    # The staging buffers' copy is one copy too many where the kernel copies into the page cache
    # anyway (200 MB: 0.077 s a save against 0.091 s staged, medians): only small writes use them.
    from concurrent.futures import ThreadPoolExecutor

    from trainfsm.checkpoint.io import serialize

    staging = Staging()
    for view in staging.views:
        view[:] = b"\xab" * BUFFER_BYTES
    state = {"weight": torch.randn(3 * BUFFER_BYTES // 4 + 5), "step": 7, "small": torch.arange(10)}
    with ThreadPoolExecutor(1) as io:
        writer = DurableWriter(tmp_path / "f.pt", io, staging, direct=False)
        serialize(state, writer)
        entry = writer.finish()
    data = (tmp_path / "f.pt").read_bytes()
    assert entry == {"bytes": len(data), "digest": file_sum(data)} and len(data) > 3 * BUFFER_BYTES
    loaded = torch.load(tmp_path / "f.pt")
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["step"] == 7
    staged = sum(BUFFER_BYTES - bytes(view).count(0xAB) for view in staging.views)
    assert staged < 1 << 20  # the pickle and the zip's headers (a few kB); not the 12 MB tensor


@pytest.mark.parametrize("piece", [FROM_CALLER_BYTES, FROM_CALLER_BYTES // 2], ids=["from torch's memory", "staged"])
def test_a_piece_is_hashed_while_the_io_thread_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    # The sum is not on the disk's path: the write is queued first, then the same bytes are hashed.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    disk, writing = threading.Event(), threading.Event()
    pwrite = os.pwrite
    seen: list[bool] = []

    def stalled(fd: int, data: Any, offset: int) -> int:
        writing.set()
        disk.wait(timeout=30)
        return pwrite(fd, data, offset)

    class Spy:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def update(self, data: Any) -> None:
            seen.append(writing.wait(timeout=2))  # its write already on the I/O thread?
            disk.set()
            self.inner.update(data)

        def hexdigest(self) -> str:
            return str(self.inner.hexdigest())

    monkeypatch.setattr(os, "pwrite", stalled)
    data = os.urandom(BUFFER_BYTES)
    with ThreadPoolExecutor(1) as io:
        writer = DurableWriter(tmp_path / "f", io, Staging(), direct=False)
        writer._hash = Spy(writer._hash)
        try:
            for start in range(0, len(data), piece):
                writer.write(data[start : start + piece])
            entry = writer.finish()
        finally:
            disk.set()
    assert seen and seen[0]  # the first bytes hashed were being written already
    assert (tmp_path / "f").read_bytes() == data and entry == {"bytes": len(data), "digest": file_sum(data)}


def test_a_save_does_not_wait_for_its_files_pages_to_be_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Dropping a durable file's clean pages (~12 ms per 200 MB) runs on a thread of its own: on the
    # I/O thread the next file's writes waited behind it.
    import threading

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise: no pages are dropped")
    release, dropping = threading.Event(), threading.Event()
    fadvise = os.posix_fadvise

    def slow_drop(fd: int, offset: int, length: int, advice: int) -> None:
        if (offset, length) == (0, 0):  # the whole file's, after its fsync
            dropping.set()
            release.wait(timeout=30)
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", slow_drop)
    store = CheckpointStore(tmp_path, direct_io=False)
    store.prepare()
    parts = {"model": {"w": torch.randn(1 << 20)}, "training_state": {"step": 1}}
    saving = threading.Thread(target=store.save, args=(1, parts), kwargs={"keep": False})
    try:
        saving.start()
        saving.join(timeout=20)
        assert dropping.is_set() and not saving.is_alive()  # saved while model.pt's drop still waits
    finally:
        release.set()
        saving.join(timeout=30)
        store.close()
    loaded = CheckpointStore.load(tmp_path / "1")
    assert torch.equal(loaded["model"]["w"], parts["model"]["w"])


def _direct_io_works(directory: Path) -> bool:
    fd, direct = open_for_writing(directory / "probe", True)
    os.close(fd)
    return direct


def test_files_bypass_the_page_cache_and_are_cut_to_their_size(tmp_path: Path) -> None:
    if not _direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    data = os.urandom(3 * BUFFER_BYTES + 1234)  # the last buffer is padded for O_DIRECT, then cut
    entry, direct = write_file(tmp_path / "f", [data[:10], data[10:]])
    assert direct
    assert (tmp_path / "f").read_bytes() == data
    assert entry == {"bytes": len(data), "digest": file_sum(data)}


def test_a_write_that_refuses_o_direct_goes_on_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some file systems accept O_DIRECT at open() and refuse it at write() with EINVAL.
    import errno
    import fcntl

    if not _direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    pwrite = os.pwrite
    refused = []

    def picky(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", picky)
    data = os.urandom(2 * BUFFER_BYTES + 99)
    entry, direct = write_file(tmp_path / "f", [data])
    assert refused == [0] and not direct  # the first write is refused, the file goes on without O_DIRECT
    assert (tmp_path / "f").read_bytes() == data
    assert entry == {"bytes": len(data), "digest": file_sum(data)}


def test_without_direct_io_files_go_through_the_page_cache(tmp_path: Path) -> None:
    data = os.urandom(BUFFER_BYTES + 5)
    entry, direct = write_file(tmp_path / "f", [data], direct=False)
    assert not direct and (tmp_path / "f").read_bytes() == data
    assert entry["digest"] == file_sum(data)


def test_each_buffers_writeback_starts_when_it_is_written_not_at_the_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through the page cache the disk would otherwise idle until the fsync (issue 14: 1 GB took
    # 3.0 s written then fsynced, 1.6 s with each 4 MiB's writeback started at once).
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform")
    calls: list[tuple[Any, ...]] = []
    pwrite, fadvise, fsync = os.pwrite, os.posix_fadvise, os.fsync

    def write(fd: int, data: Any, offset: int) -> int:
        calls.append(("write", offset))
        return pwrite(fd, data, offset)

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append(("writeback", offset, length, advice))
        fadvise(fd, offset, length, advice)

    def sync(fd: int) -> None:
        calls.append(("fsync",))
        fsync(fd)

    monkeypatch.setattr(os, "pwrite", write)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "fsync", sync)
    data = os.urandom(2 * BUFFER_BYTES + 7)
    write_file(tmp_path / "f", [data], direct=False)
    dontneed = os.POSIX_FADV_DONTNEED
    assert calls == [
        ("write", 0),
        ("writeback", 0, BUFFER_BYTES, dontneed),
        ("write", BUFFER_BYTES),
        ("writeback", BUFFER_BYTES, BUFFER_BYTES, dontneed),
        ("write", 2 * BUFFER_BYTES),
        ("writeback", 2 * BUFFER_BYTES, 7, dontneed),
        ("fsync",),
        ("writeback", 0, 0, dontneed),  # clean now: the checkpoint leaves the page cache to the data
    ]
    assert (tmp_path / "f").read_bytes() == data


def test_a_file_system_that_refuses_the_writeback_hint_still_gets_a_durable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    def refuse(fd: int, offset: int, length: int, advice: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    data = os.urandom(BUFFER_BYTES + 11)
    entry, _ = write_file(tmp_path / "f", [data], direct=False)
    assert (tmp_path / "f").read_bytes() == data and entry == {"bytes": len(data), "digest": file_sum(data)}


def test_a_disk_full_in_the_background_write_loses_no_earlier_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, 4)
    monkeypatch.setattr(os, "pwrite", _disk_full)  # the writer thread's write, not torch's call
    trainer = Trainer(CheckpointingHook(interval=4), max_steps=8, workspace=tmp_path)
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["4", "latest"]  # no partial 8, no temp dir
    CheckpointStore.verify(root / "4")


def test_checkpoint_files_skip_torchs_crc32_and_still_load_with_plain_torch_load(tmp_path: Path) -> None:
    # The manifest's sums cover every byte, so torch's per-record crc32 (half of torch.save's time) is
    # left out; this also checks that the installed torch still takes that path.
    state = {"w": torch.randn(1000), "b": torch.arange(3)}
    checkpoint, _, _ = CheckpointStore(tmp_path).save(1, {"model": state}, keep=False)
    with zipfile.ZipFile(checkpoint.path / "model.pt") as archive:
        records = archive.infolist()
    assert len(records) >= 3 and all(record.CRC == 0 for record in records)
    loaded = torch.load(checkpoint.path / "model.pt", weights_only=True)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_format_1_checkpoint_with_one_sha256_per_file_still_loads(tmp_path: Path) -> None:
    run(tmp_path, 4)
    directory = tmp_path / "checkpoints" / "4"
    as_older_format(directory, 1, lambda data: {"sha256": hashlib.sha256(data).hexdigest()})
    assert_loads_then_finds_a_flipped_byte(directory, "sha256")


def as_older_format(directory: Path, fmt: int, sums: Any, checksum: str | None = None) -> None:
    """Rewrite a checkpoint's manifest as trainfsm wrote format ``fmt`` (formats 1-3: sha256 and no
    "checksum" key): each file's entry is its size and ``sums(its bytes)``."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format"] = fmt
    manifest.pop("checksum", None)
    if checksum is not None:
        manifest["checksum"] = checksum
    manifest["files"] = {
        name: {"bytes": entry["bytes"], **sums((directory / name).read_bytes())}
        for name, entry in manifest["files"].items()
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


def assert_loads_then_finds_a_flipped_byte(directory: Path, algorithm: str) -> None:
    assert CheckpointStore.load(directory)["training_state"]["step"] == 4
    (directory / "model.pt").write_bytes(b"x" + (directory / "model.pt").read_bytes()[1:])
    with pytest.raises(CheckpointError, match=f"does not match its {algorithm}"):
        CheckpointStore.verify(directory)


def test_a_flipped_byte_deep_in_a_large_file_is_found(tmp_path: Path) -> None:
    state = {"w": torch.randn(9 << 20)}  # 36 MiB: nine staging buffers
    checkpoint, _, _ = CheckpointStore(tmp_path).save(1, {"model": state}, keep=False)
    model = checkpoint.path / "model.pt"
    with open(model, "r+b") as f:
        f.seek(33 << 20)
        byte = f.read(1)
        f.seek(33 << 20)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointError, match=f"{model} does not match its xxh3_128"):
        CheckpointStore.verify(checkpoint.path)


# ---------------------------------------------------------------- max_epochs (5 batches an epoch)
def test_max_epochs_saves_the_last_completed_step_once(tmp_path: Path) -> None:
    trainer = Trainer(CheckpointingHook(interval=4), max_steps=100, max_epochs=2, workspace=tmp_path)
    trainer.train()
    assert trainer.step == 10
    assert [e["saved_step"] for e in events(tmp_path, "checkpoint_saved")] == [4, 8, 10]


def test_max_epochs_ending_at_an_interval_step_does_not_save_it_twice(tmp_path: Path) -> None:
    Trainer(CheckpointingHook(interval=5), max_steps=100, max_epochs=2, workspace=tmp_path).train()
    assert [e["saved_step"] for e in events(tmp_path, "checkpoint_saved")] == [5, 10]


def test_a_run_resumed_inside_max_epochs_ends_exactly_like_an_uninterrupted_one(tmp_path: Path) -> None:
    torch.manual_seed(1)
    random.seed(1)
    straight = Trainer(CheckpointingHook(interval=3), max_steps=100, max_epochs=2, workspace=tmp_path / "a")
    straight.train()
    torch.manual_seed(1)
    random.seed(1)
    Trainer(CheckpointingHook(interval=3), max_steps=7, max_epochs=2, workspace=tmp_path / "b").train()
    torch.manual_seed(123)  # the checkpoint's random states must win over whatever the process has
    resumed = Trainer(CheckpointingHook(interval=3), max_steps=100, max_epochs=2, workspace=tmp_path / "b")
    resumed.train()
    assert (straight.step, resumed.step) == (10, 10)
    assert all(torch.equal(a, b) for a, b in zip(params(straight), params(resumed), strict=True))
    again = Trainer(CheckpointingHook(interval=3), max_steps=100, max_epochs=2, workspace=tmp_path / "b")
    again.train()  # at the end of the data already: nothing trained, nothing saved
    assert again.step == 10
    assert [e["saved_step"] for e in events(tmp_path / "b", "checkpoint_saved")] == [3, 6, 7, 9, 10]


# ---------------------------------------------------------------- the checksum
def test_checksum_sha256_is_named_in_the_manifest_and_verified(tmp_path: Path) -> None:
    run(tmp_path, 4, checksum="sha256")
    directory = tmp_path / "checkpoints" / "4"
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["checksum"] == "sha256"
    for name, entry in manifest["files"].items():
        assert entry["digest"] == file_sum((directory / name).read_bytes(), "sha256")
    assert_loads_then_finds_a_flipped_byte(directory, "sha256")


def test_a_checkpoint_resumes_whichever_checksum_wrote_it(tmp_path: Path) -> None:
    straight = run(tmp_path / "a", 8)
    run(tmp_path / "b", 4, checksum="sha256")
    resumed = run(tmp_path / "b", 8)  # xxh3_128 now: the sha256 manifest of step 4 still verifies
    assert resumed.hook.loaded_from == tmp_path / "b" / "checkpoints" / "4"
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):  # type: ignore[union-attr]
        assert torch.equal(a, b)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_format_2_or_3_manifest_of_sha256_chunks_still_loads_and_verifies(tmp_path: Path, sharded: bool) -> None:
    """What trainfsm wrote before format 4: no "checksum" key, a "sha256_chunks" list per file."""
    run(tmp_path, 4)
    directory = tmp_path / "checkpoints" / "4"
    as_older_format(
        directory,
        3 if sharded else 2,
        lambda data: {"chunk_bytes": OLD_CHUNK, "sha256_chunks": chunk_sums(data, "sha256")},
    )
    assert_loads_then_finds_a_flipped_byte(directory, "sha256")


@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
def test_a_format_4_manifest_of_chunk_sums_still_loads_and_verifies(tmp_path: Path, checksum: str) -> None:
    """What trainfsm wrote before format 5: the manifest names its checksum, each file lists a sum per 4 MiB."""
    run(tmp_path, 4)
    directory = tmp_path / "checkpoints" / "4"
    as_older_format(
        directory, 4, lambda data: {"chunk_bytes": OLD_CHUNK, "chunks": chunk_sums(data, checksum)}, checksum
    )
    assert_loads_then_finds_a_flipped_byte(directory, checksum)


def test_a_manifest_naming_an_unknown_checksum_is_skipped_with_the_reason(tmp_path: Path) -> None:
    run(tmp_path, 4)
    directory = tmp_path / "checkpoints" / "4"
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**manifest, "checksum": "md5"}))
    with pytest.raises(CheckpointError, match="names checksum 'md5'; this trainfsm verifies xxh3_128, sha256"):
        CheckpointStore.verify(directory)


@pytest.mark.parametrize("owner", ["CheckpointingHook", "CheckpointStore"])
def test_a_bad_checksum_argument_is_named(tmp_path: Path, owner: str) -> None:
    with pytest.raises(ValueError, match=f"{owner} checksum must be one of 'xxh3_128', 'sha256'.*got 'md5'"):
        if owner == "CheckpointingHook":
            CheckpointingHook(interval=1, checksum="md5")  # type: ignore[arg-type]
        else:
            CheckpointStore(tmp_path, checksum="md5")


def test_the_writers_one_off_set_up_happens_in_restore_not_in_the_first_save(tmp_path: Path) -> None:
    class Watch(BaseHook):
        def on_before_train(self, trainer: Any) -> None:
            self.staging = trainer.hooks[0].store._staging  # made in RESTORE, before the first step

    class Watched(Trainer):
        def build_hooks(self) -> list[Any]:
            return [hook, watch]

    watch = Watch()
    hook = CheckpointingHook(interval=2)
    Watched(hook, max_steps=4, workspace=tmp_path).train()
    assert watch.staging is not None
    assert hook.store is not None and hook.store._staging is None  # closed at EXIT
    ready = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_store_ready"]
    assert len(ready) == 1 and ready[0]["state"] == "RESTORE" and ready[0]["seconds"] >= 0


def test_load_names_a_pointer_that_is_a_plain_file_where_links_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*_: Any, **__: Any) -> None:
        raise OSError("symlinks not supported")

    monkeypatch.setattr(Path, "symlink_to", no_links)
    run(tmp_path, 8, interval=4, keep_previous=1)
    root = tmp_path / "checkpoints"
    CheckpointStore(root).point("best", "4")
    assert (root / "best").read_text() == "4\n"
    resumed = Trainer(CheckpointingHook(interval=4, load="best"), max_steps=8, workspace=tmp_path)
    resumed.train()
    assert [e["path"] for e in events(tmp_path, "checkpoint_loaded")] == [str(root / "4")]


def test_a_save_writes_its_next_file_before_it_fsyncs_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fsyncs come after the last file: a small file's pickling is hidden behind a large file's
    # draining writeback, and each fsync waits only for what is left of its own file.
    calls: list[tuple[str, str]] = []
    pwrite, fsync = os.pwrite, os.fsync

    def write(fd: int, data: Any, offset: int) -> int:
        calls.append(("write", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return pwrite(fd, data, offset)

    def sync(fd: int) -> None:
        calls.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    store = CheckpointStore(tmp_path, direct_io=False)
    store.prepare()
    monkeypatch.setattr(os, "pwrite", write)
    monkeypatch.setattr(os, "fsync", sync)
    store.save(1, {"model": {"w": torch.randn(1 << 20)}, "training_state": {"step": 1}}, keep=False)
    monkeypatch.undo()
    store.close()
    files = [(what, name) for what, name in calls if name.endswith(".pt")]
    last_write = max(i for i, call in enumerate(files) if call[0] == "write")
    first_fsync = min(i for i, call in enumerate(files) if call[0] == "fsync")
    assert files[last_write] == ("write", "training_state.pt") and last_write < first_fsync
    assert [call for call in files if call[0] == "fsync"] == [("fsync", "model.pt"), ("fsync", "training_state.pt")]
    CheckpointStore.verify(tmp_path / "1")
