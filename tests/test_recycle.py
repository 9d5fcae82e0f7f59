"""A store writes its checkpoints over the files of the ones it pruned, and RESTORE reserves the
room of the first save: a file's blocks are found once, not at every save (issue 35).

On this machine's disk (ext4 with online discard, on a virtual disk) writing over a file's blocks
took 0.068 s per 200 MB with ``O_DIRECT`` against 0.110 s for a new file, and deleting a file took
0.04-0.05 s, which every save after the first paid before. The tests follow the files by inode:
the file a save writes is the one pruning kept, or the one RESTORE wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.checkpoint.store import RECYCLE, RECYCLED_BYTES, CheckpointStore

LARGE = RECYCLED_BYTES // 4 + 4096  # float32 elements: a tensor just over the size worth recycling


def state(step: int, elements: int = LARGE) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(elements, generator=generator)}, "training_state": {"step": step}}


def inode(path: Path) -> int:
    return path.stat().st_ino


def recycled(root: Path) -> dict[int, int]:
    """inode -> bytes of each file kept for recycling."""
    directory = root / RECYCLE
    return {inode(f): f.stat().st_size for f in directory.iterdir()} if directory.is_dir() else {}


def test_the_next_save_writes_over_the_pruned_checkpoints_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, state(1), keep=False)
    pruned_model = inode(tmp_path / "1" / "model.pt")
    store.save(2, state(2), keep=False)
    store.prune(keep_previous=0)
    assert not (tmp_path / "1").exists()
    assert list(recycled(tmp_path)) == [pruned_model]  # the small training_state.pt was deleted
    store.save(3, state(3), keep=False)
    assert inode(tmp_path / "3" / "model.pt") == pruned_model
    assert recycled(tmp_path) == {}
    loaded = CheckpointStore.load(tmp_path / "3")
    assert torch.equal(loaded["model"]["w"], state(3)["model"]["w"])


def test_a_file_written_over_a_larger_one_is_cut_to_its_size_and_verifies(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        store.save(step, state(step, elements=2 * LARGE), keep=False)
    store.prune(keep_previous=0)
    ((kept, large),) = recycled(tmp_path).items()
    store.save(3, state(3), keep=False)
    assert inode(tmp_path / "3" / "model.pt") == kept
    manifest = json.loads((tmp_path / "3" / "manifest.json").read_text())
    size = (tmp_path / "3" / "model.pt").stat().st_size
    assert size == manifest["files"]["model.pt"]["bytes"] < large
    CheckpointStore.verify(tmp_path / "3")
    assert torch.equal(CheckpointStore.load(tmp_path / "3")["model"]["w"], state(3)["model"]["w"])


def test_small_files_are_deleted_as_before(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        store.save(step, state(step, elements=1000), keep=False)
    store.prune(keep_previous=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "latest"]


def test_the_files_kept_stay_within_the_newest_checkpoints_size(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        store.save(step, state(step), keep=False)
    pruned = store.prune(keep_previous=0)
    assert [c.step for c in pruned] == [1, 2]
    newest = (tmp_path / "3" / "model.pt").stat().st_size + (tmp_path / "3" / "training_state.pt").stat().st_size
    assert len(recycled(tmp_path)) == 1 and sum(recycled(tmp_path).values()) <= newest


def test_close_deletes_the_files_kept_for_recycling(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        store.save(step, state(step), keep=False)
    store.prune(keep_previous=0)
    assert recycled(tmp_path)
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "latest"]


def test_restore_removes_what_a_crashed_run_kept_for_recycling(tmp_path: Path) -> None:
    (tmp_path / RECYCLE).mkdir()
    (tmp_path / RECYCLE / "0123456789ab.pt").write_bytes(b"x" * 4096)
    assert CheckpointStore(tmp_path).remove_leftovers() == [RECYCLE]
    assert not (tmp_path / RECYCLE).exists()


def test_a_save_that_fails_over_a_recycled_file_leaves_the_latest_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        store.save(step, state(step), keep=False)
    store.prune(keep_previous=0)
    broken = {**state(3), "training_state": {"step": 3, "unpicklable": lambda: None}}
    with pytest.raises(Exception):  # noqa: B017 - pickle's error type varies with the object
        store.save(3, broken, keep=False)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["2", "latest"]
    assert not list(tmp_path.glob(".tmp-3-*"))
    assert torch.equal(CheckpointStore.load(tmp_path / "2")["model"]["w"], state(2)["model"]["w"])


def test_reserve_writes_a_file_the_first_save_writes_over(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    nbytes = LARGE * 4
    assert store.reserve({"model": nbytes, "training_state": 100}) >= nbytes  # the small one is not reserved
    ((reserved, size),) = recycled(tmp_path).items()
    assert size >= nbytes
    store.save(1, state(1), keep=False)
    assert inode(tmp_path / "1" / "model.pt") == reserved
    CheckpointStore.verify(tmp_path / "1")


def test_reserve_writes_nothing_where_the_files_kept_hold_enough(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.reserve({"model": LARGE * 4}) > 0
    assert store.reserve({"model": LARGE * 4}) == 0
    assert store.reserve({"model": 1000}) == 0
    assert len(recycled(tmp_path)) == 1


def test_reserve_fails_in_restore_where_the_disk_has_no_room(tmp_path: Path, monkeypatch: Any) -> None:
    import os

    from trainfsm.checkpoint import io

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.os, "pwrite", full)
    store = CheckpointStore(tmp_path, direct_io=False)
    with pytest.raises(OSError, match="No space left"):
        store.reserve({"model": LARGE * 4})
    monkeypatch.setattr(io.os, "pwrite", os.pwrite)
    assert recycled(tmp_path) == {}  # nothing half-written is kept


class Wide(BaseTrainer):
    """A model just over the size worth reserving, plain SGD: the first save's files are known."""

    def __init__(self, hooks: list[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook_list = hooks

    def build_data_loader(self) -> Any:
        return [torch.randn(2, 1536)]

    def build_model(self) -> nn.Module:
        return nn.Linear(1536, 1536, bias=False)  # 9.4 MB

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        return self.hook_list

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.model(input).square().mean(), {}  # type: ignore[misc]


class SeeReserved(BaseHook):
    """At the first step (after RESTORE): the inodes of the files kept for the first save."""

    def __init__(self) -> None:
        self.inodes: dict[int, int] | None = None

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if self.inodes is None:
            self.inodes = recycled(trainer.workspace / "checkpoints")


def test_restore_reserves_the_first_saves_room_and_the_first_save_uses_it(tmp_path: Path) -> None:
    seen = SeeReserved()
    trainer = Wide([CheckpointingHook(interval=1), seen], max_steps=1, workspace=tmp_path, device="cpu")
    trainer.train()
    assert seen.inodes and max(seen.inodes.values()) >= 1536 * 1536 * 4
    assert inode(tmp_path / "checkpoints" / "1" / "model.pt") in seen.inodes
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.rank0.jsonl").read_text().splitlines()]
    (reserved,) = [e for e in events if e["event"] == "checkpoint_room_reserved"]
    assert reserved["bytes"] >= 1536 * 1536 * 4 and reserved["seconds"] > 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "latest"]  # EXIT: none kept


def test_a_full_disk_fails_restore_with_what_to_do(tmp_path: Path, monkeypatch: Any) -> None:
    import errno
    import os

    from trainfsm.checkpoint import io
    from trainfsm.checkpoint.store import CheckpointError

    real = os.pwrite

    def full(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").find(RECYCLE) >= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(io.os, "pwrite", full)
    trainer = Wide([CheckpointingHook(interval=1)], max_steps=1, workspace=tmp_path, device="cpu")
    with pytest.raises(CheckpointError, match=r"has no room for a checkpoint.*CheckpointingHook\(path=\.\.\.\)"):
        trainer.train()
    assert not (tmp_path / "checkpoints" / RECYCLE).exists()  # EXIT deleted what was reserved
