"""A store writes its checkpoints over the files of the ones it pruned, and RESTORE reserves the
room of the first save: a file's blocks are found once, not at every save (issue 35).

On this machine's disk (ext4 with online discard, on a virtual disk) writing over a file's blocks
took 0.068 s per 200 MB with ``O_DIRECT`` against 0.110 s for a new file, and deleting a file took
0.04-0.05 s, which every save after the first paid before. The tests follow the files by inode:
the file a save writes is the one pruning kept, or the one RESTORE wrote.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.checkpoint.io import BUFFER_BYTES
from trainfsm.checkpoint.store import RECYCLE, RECYCLED_BYTES, CheckpointError, CheckpointStore

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


def test_a_file_with_an_older_files_tail_fails_verification(tmp_path: Path) -> None:
    # What a file written over a larger one would be without its cut (the writer opens it without
    # O_TRUNC, torch's crc32 is off, and torch.load may read the old tail's central directory):
    # the manifest's size and checksum find it before torch reads a byte.
    store = CheckpointStore(tmp_path)
    store.save(1, state(1, elements=2 * LARGE), keep=False)
    store.save(2, state(2), keep=False)
    older, newer = (tmp_path / "1" / "model.pt").read_bytes(), tmp_path / "2" / "model.pt"
    newer.write_bytes(newer.read_bytes() + older[newer.stat().st_size :])
    with pytest.raises(CheckpointError, match=r"model.pt has \d+ bytes, the manifest says \d+"):
        CheckpointStore.load(tmp_path / "2")
    store.close()


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


def test_restore_keeps_what_a_crashed_run_kept_for_recycling_as_the_next_saves_room(tmp_path: Path) -> None:
    crashed = CheckpointStore(tmp_path)  # never closed
    for step in (1, 2):
        crashed.save(step, state(step), keep=False)
    crashed.prune(keep_previous=0)
    kept = recycled(tmp_path)
    store = CheckpointStore(tmp_path)
    assert store.remove_leftovers() == []
    assert recycled(tmp_path) == kept
    # The newest checkpoint and the kept file: the room of keep_previous=0's two, nothing to add.
    assert store.reserve({"model": LARGE * 4}, copies=2) == (0, True, 0)
    store.save(3, state(3), keep=False)
    assert inode(tmp_path / "3" / "model.pt") in kept


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
    assert store.reserve({"model": nbytes, "training_state": 100}).bytes >= nbytes  # the small one is not reserved
    ((reserved, size),) = recycled(tmp_path).items()
    assert size >= nbytes
    store.save(1, state(1), keep=False)
    assert inode(tmp_path / "1" / "model.pt") == reserved
    CheckpointStore.verify(tmp_path / "1")


def test_reserve_writes_nothing_where_the_files_kept_hold_enough(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.reserve({"model": LARGE * 4}).bytes > 0
    assert store.reserve({"model": LARGE * 4}) == (0, True, 0)
    assert store.reserve({"model": 1000}) == (0, True, 0)
    assert len(recycled(tmp_path)) == 1


def test_reserve_fails_in_restore_where_the_disk_has_no_room(tmp_path: Path, monkeypatch: Any) -> None:

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
    """Listed after CheckpointingHook: the inodes of the files kept for the first saves (at the
    first step, after RESTORE), and of each save's model.pt."""

    def __init__(self) -> None:
        self.inodes: dict[int, int] | None = None
        self.saved: list[int] = []

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if self.inodes is None:
            self.inodes = recycled(trainer.workspace / "checkpoints")

    def on_enter_checkpoint(self, trainer: BaseTrainer) -> None:
        self.saved.append(inode(trainer.workspace / "checkpoints" / "latest" / "model.pt"))


def test_restore_reserves_the_room_of_the_saves_before_the_first_prune(tmp_path: Path) -> None:
    # keep_previous=0: the first save, and the second, after which the first is pruned and recycled.
    seen = SeeReserved()
    trainer = Wide([CheckpointingHook(interval=1), seen], max_steps=3, workspace=tmp_path, device="cpu")
    trainer.train()
    assert seen.inodes is not None and len(seen.inodes) == 2
    assert min(seen.inodes.values()) >= 1536 * 1536 * 4
    first, second, third = seen.saved
    assert {first, second} == set(seen.inodes)  # both written over the reserved files
    assert third == first  # the third over the first save's, pruned after the second
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.rank0.jsonl").read_text().splitlines()]
    (reserved,) = [e for e in events if e["event"] == "checkpoint_room_reserved"]
    assert reserved["bytes"] == sum(seen.inodes.values()) and reserved["seconds"] > 0 and reserved["complete"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "latest"]  # EXIT: none kept


@pytest.mark.parametrize("keep_previous", [1, 2])
def test_each_checkpoint_kept_adds_one_reserved_copy(tmp_path: Path, keep_previous: int) -> None:
    seen = SeeReserved()
    hook = CheckpointingHook(interval=1, keep_previous=keep_previous)
    Wide([hook, seen], max_steps=1, workspace=tmp_path, device="cpu").train()
    assert seen.inodes is not None and len(seen.inodes) == keep_previous + 2


def test_a_full_disk_fails_restore_with_what_to_do(tmp_path: Path, monkeypatch: Any) -> None:
    import errno

    from trainfsm.checkpoint import io
    from trainfsm.checkpoint.store import CheckpointError

    real = os.pwrite

    def full(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").find(RECYCLE) >= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(io.os, "pwrite", full)
    trainer = Wide([CheckpointingHook(interval=1)], max_steps=1, workspace=tmp_path, device="cpu")
    no_room = r"has no room for this run's checkpoints.*CheckpointingHook\(path=\.\.\.\)"
    with pytest.raises(CheckpointError, match=no_room):
        trainer.train()
    assert not (tmp_path / "checkpoints" / RECYCLE).exists()  # EXIT deleted what was reserved


# ------------------------------------------------------------------ pages kept in the page cache
def resident(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` over a read-only map)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in vector) / pages


@pytest.fixture
def page_cache_drops(tmp_path: Path) -> None:
    """Skip where the file system keeps every page (tmpfs) or the kernel cannot drop them."""

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise: pages are never dropped")
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(1 << 20))
    fd = os.open(probe, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    dropped = resident(probe) < 0.5
    probe.unlink()
    if not dropped:
        pytest.skip("this file system keeps its pages in memory (tmpfs?)")


def test_a_file_the_next_saves_write_over_keeps_its_pages_cached(tmp_path: Path, page_cache_drops: None) -> None:
    # Written over, cached pages need no fresh memory: after 4 s idle 200 MB took 0.079 s so and
    # 0.634 s with its pages dropped (a virtual machine's free memory goes back to its host).
    store = CheckpointStore(tmp_path, direct_io=False)
    store.save(1, state(1), keep=False)
    store.save(2, state(2), keep=False)
    store.prune(keep_previous=0)
    assert store._drops is not None
    store._drops.submit(lambda: None).result()  # any page drop in flight is done
    assert resident(tmp_path / "2" / "model.pt") > 0.9  # the next save's prune recycles it
    ((kept, _),) = recycled_paths(tmp_path).items()
    assert resident(kept) > 0.9
    store.close()


def test_a_kept_checkpoint_and_small_files_leave_the_page_cache(tmp_path: Path, page_cache_drops: None) -> None:
    # Never written over, so their pages would only push the training data out of the cache.
    for root, keep, elements in [(tmp_path / "kept", True, LARGE), (tmp_path / "small", False, RECYCLED_BYTES // 8)]:
        store = CheckpointStore(root, direct_io=False)
        checkpoint, _, _ = store.save(1, state(1, elements), keep=keep)
        store.close()  # waits for the drops in flight
        assert resident(checkpoint.path / "model.pt") < 0.1


def test_restores_reservation_is_written_with_its_pages_cached(tmp_path: Path, page_cache_drops: None) -> None:
    store = CheckpointStore(tmp_path, direct_io=False)
    store.reserve({"model": RECYCLED_BYTES})
    ((kept, _),) = recycled_paths(tmp_path).items()
    assert resident(kept) > 0.9
    store.close()


def recycled_paths(root: Path) -> dict[Path, int]:
    return {f: f.stat().st_size for f in (root / RECYCLE).iterdir()}


# ------------------------------------------------------------------ the optimizer's room, before its first step
class Model(BaseTrainer):
    """Just enough of a trainer for ``optimizer_state_bytes``: a model and an optimizer."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer


@pytest.mark.parametrize(
    ("make", "per_byte"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), 0.0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1.0),
        (lambda p: torch.optim.Adam(p, lr=0.1), 2.0),
        (lambda p: torch.optim.AdamW(p, lr=0.1, amsgrad=True), 3.0),
    ],
    ids=["sgd", "momentum", "adam", "adamw-amsgrad"],
)
def test_an_optimizer_without_state_yet_is_reserved_what_its_first_step_makes(make: Any, per_byte: float) -> None:
    from trainfsm.checkpoint.restore import optimizer_state_bytes

    model = nn.Linear(256, 256)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = make(model.parameters())
    estimate = optimizer_state_bytes(Model(optimizer))  # type: ignore[arg-type]
    held = sum(p.numel() * 4 for p in model.parameters())
    assert estimate == pytest.approx(per_byte * held, rel=0.01, abs=64)
    # Estimated on a toy optimizer: the trainer's was not stepped and has no state yet.
    assert len(optimizer.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for p in model.parameters():  # and what its first step makes is what was estimated
        p.grad = torch.ones_like(p)
    optimizer.step()
    from trainfsm.checkpoint.io import tensor_bytes

    assert tensor_bytes(list(optimizer.state.values())) == pytest.approx(estimate, rel=0.01, abs=64)


def test_an_optimizer_that_cannot_be_remade_from_its_settings_gets_no_estimate() -> None:
    from trainfsm.checkpoint.restore import optimizer_state_bytes

    class Needy(torch.optim.SGD):
        def __init__(self, params: Any, schedule: list[float], **kwargs: Any) -> None:
            super().__init__(params, **kwargs)

    optimizer = Needy(nn.Linear(8, 8).parameters(), [1.0], lr=0.1, momentum=0.9)
    assert optimizer_state_bytes(Model(optimizer)) == 0  # type: ignore[arg-type]


# ------------------------------------------------------------------ a signal during the reservation
def test_reserve_stops_where_asked_and_leaves_only_whole_files(tmp_path: Path) -> None:
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 5  # during the second file (three buffers each)

    store = CheckpointStore(tmp_path)
    reserved = store.reserve({"model": 3 * BUFFER_BYTES}, copies=3, stop=stop)
    assert reserved == (3 * BUFFER_BYTES, False, 0)
    assert list(recycled(tmp_path).values()) == [3 * BUFFER_BYTES]  # the one cut short is gone
    store.close()


class SignalWhileReserving(BaseHook):
    """Sends SIGUSR1 to this process at the reservation's second write (CheckpointingHook's
    exit signals are installed by then)."""

    def __init__(self, monkeypatch: Any) -> None:
        from trainfsm.checkpoint import io

        real = io.DurableWriter.write
        self.writes = 0

        def write(writer: Any, data: Any) -> int:
            if RECYCLE in str(writer._path):
                self.writes += 1
                if self.writes == 2:
                    os.kill(os.getpid(), signal.SIGUSR1)
            return real(writer, data)

        monkeypatch.setattr(io.DurableWriter, "write", write)


def test_a_signal_during_restores_reservation_stops_it_and_the_run_leaves_from_restore(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # 4 GB took 11.5 s to reserve here: a preempted run must not wait for it.
    sender = SignalWhileReserving(monkeypatch)
    trainer = Wide([CheckpointingHook(interval=1), sender], max_steps=2, workspace=tmp_path, device="cpu")
    with pytest.raises(SystemExit) as exited:
        trainer.train()
    assert exited.value.code == 138
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.rank0.jsonl").read_text().splitlines()]
    (reserved,) = [e for e in events if e["event"] == "checkpoint_room_reserved"]
    assert reserved["complete"] is False and reserved["bytes"] == 0  # stopped in its first file
    assert sender.writes == 2  # not one write more: 2 x 9.4 MB would be ~5 of them
    transitions = [e["trigger"] for e in events if e["event"] == "transition"]
    assert transitions == ["built", "preempt"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []  # EXIT deleted the reserved files


# ------------------------------------------------------------------ nothing else sees a file written over (issue 46)
def saves_that_would_recycle(store: CheckpointStore) -> None:
    """Steps 2 and 3 after step 1, pruned as a run prunes: step 1's model.pt is the file step 3
    would write over."""
    for step in (2, 3):
        store.save(step, state(step), keep=False)
        store.prune(keep_previous=0)


def test_a_hard_link_to_a_pruned_checkpoints_file_keeps_its_bytes(tmp_path: Path) -> None:
    # A user pinning a step with `ln`, or a backup with `cp -al` / `rsync --link-dest`.
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(1, state(1), keep=False)
    pinned = tmp_path / "pinned-step-1.pt"
    os.link(tmp_path / "checkpoints" / "1" / "model.pt", pinned)
    saves_that_would_recycle(store)
    assert torch.equal(torch.load(pinned, weights_only=True)["w"], state(1)["model"]["w"])
    assert inode(tmp_path / "checkpoints" / "3" / "model.pt") != inode(pinned)
    assert pinned.stat().st_nlink == 1  # the store let go of its name for it: nothing kept twice
    store.close()


READER = """
import sys, torch
with open(sys.argv[1], "rb") as f:  # opened while step 1 is a checkpoint
    print("open", flush=True)
    sys.stdin.readline()  # until the saves that would write over it are done
    w = torch.load(f, weights_only=True)["w"]
expected = torch.randn(int(sys.argv[2]), generator=torch.Generator().manual_seed(1))
print("same" if torch.equal(w, expected) else "changed", flush=True)
"""


def test_a_reader_holding_a_pruned_checkpoints_file_open_keeps_its_bytes(tmp_path: Path) -> None:
    # An evaluation or upload job that opened step 1 before it was pruned.
    import subprocess
    import sys

    store = CheckpointStore(tmp_path)
    store.save(1, state(1), keep=False)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(tmp_path / "1" / "model.pt"), str(LARGE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None and reader.stdin is not None
    try:
        assert reader.stdout.readline() == "open\n"
        saves_that_would_recycle(store)
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert reader.stdout.readline() == "same\n"
    finally:
        reader.kill()
        reader.wait()
    store.close()


def test_a_kept_file_linked_after_its_prune_is_not_written_over(tmp_path: Path) -> None:
    # A copy of the whole root with hard links (`cp -al checkpoints backup`) links the recycle bin's files too.
    store = CheckpointStore(tmp_path / "checkpoints")
    for step in (1, 2):
        store.save(step, state(step), keep=False)
    store.prune(keep_previous=0)
    ((kept, _),) = recycled_paths(tmp_path / "checkpoints").items()
    backup = tmp_path / "backup.pt"
    os.link(kept, backup)
    before = backup.read_bytes()
    store.save(3, state(3), keep=False)
    assert backup.read_bytes() == before
    assert inode(tmp_path / "checkpoints" / "3" / "model.pt") != inode(backup)
    store.close()


# ------------------------------------------------------------------ a restart's room (issue 46)
def taken(root: Path) -> int:
    """The bytes the files under ``root`` take on the disk (their allocated blocks)."""
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if not p.is_dir() or p.is_symlink())


def written_by_this_process() -> int:
    """Bytes this process has passed to write calls so far (``wchar``: fallocate writes none)."""
    return int(Path("/proc/self/io").read_text().split("wchar:")[1].split()[0])


class DiskUse(BaseHook):
    """Listed first: this process's bytes written as RESTORE begins; at each step's start, after
    RESTORE or after the last save's prune, the bytes the checkpoints take and the bytes written."""

    def __init__(self) -> None:
        self.taken: list[int] = []
        self.written: list[int] = []
        self.loaded: int | None = None  # the inode of the model.pt RESTORE will load

    def on_enter_restore(self, trainer: BaseTrainer) -> None:
        self.written.append(written_by_this_process())
        latest = trainer.workspace / "checkpoints" / "latest" / "model.pt"
        self.loaded = inode(latest) if latest.exists() else None

    def on_before_step(self, trainer: BaseTrainer) -> None:
        self.taken.append(taken(trainer.workspace / "checkpoints"))
        self.written.append(written_by_this_process())


@pytest.fixture
def restarted(tmp_path: Path) -> tuple[DiskUse, DiskUse, Path, SeeReserved]:
    """A run saving at every step (keep_previous=0) that stops after step 3, resumed for steps 4
    and 5: the first run's and the restart's disk use, and the restart's saves. Through the page
    cache (``direct_io=False``) so that RESTORE writes nothing to measure the disk."""
    if not Path("/proc/self/io").is_file():
        pytest.skip("no /proc/self/io: this process's bytes written cannot be read")
    first, second, saves = DiskUse(), DiskUse(), SeeReserved()
    for hooks, steps in (([first], 3), ([second, saves], 5)):
        hook = CheckpointingHook(interval=1, direct_io=False)
        Wide([hooks[0], hook, *hooks[1:]], max_steps=steps, workspace=tmp_path, device="cpu").train()
    return first, second, tmp_path, saves


def test_a_restart_takes_the_disk_room_of_the_steady_state(restarted: tuple[DiskUse, DiskUse, Path, Any]) -> None:
    # The steady state: the newest checkpoint and the pruned one's model.pt, kept for the next save.
    first, second, _, _ = restarted
    steady, after_restore = first.taken[-1], second.taken[0]
    assert steady >= 2 * 1536 * 1536 * 4
    assert after_restore == steady  # before: a third checkpoint's worth more (the loaded one and two reserved)


def test_a_restart_writes_no_filler(restarted: tuple[DiskUse, DiskUse, Path, Any]) -> None:
    first, second, workspace, _ = restarted
    assert first.written[1] - first.written[0] >= 2 * 1536 * 1536 * 4  # a fresh start writes the first saves' room
    assert second.written[1] - second.written[0] < 1 << 20  # a restart writes only the trail's lines
    events = [json.loads(line) for line in (workspace / "logs" / "events.rank0.jsonl").read_text().splitlines()]
    *_, at_restart = [e for e in events if e["event"] == "checkpoint_room_reserved"]
    assert at_restart["bytes"] == 0 and at_restart["allocated"] >= 1536 * 1536 * 4 and at_restart["complete"]


def test_the_checkpoint_a_restart_loaded_is_written_over_once_pruned(
    restarted: tuple[DiskUse, DiskUse, Path, SeeReserved],
) -> None:
    # Loading it leaves it open nowhere: step 5 writes over step 3's file, as in a run that never stopped.
    _, second, _, saves = restarted
    assert second.loaded is not None
    step_4, step_5 = saves.saved
    assert step_5 == second.loaded != step_4


def test_a_restart_without_room_fails_in_restore(tmp_path: Path, monkeypatch: Any) -> None:
    import errno

    from trainfsm.checkpoint import reservation

    Wide([CheckpointingHook(interval=1)], max_steps=1, workspace=tmp_path, device="cpu").train()

    def full(directory: Path, sizes: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(reservation, "allocate", full)
    steps = SeeReserved()
    trainer = Wide([CheckpointingHook(interval=1), steps], max_steps=2, workspace=tmp_path, device="cpu")
    no_room = r"has no room for this run's checkpoints.*CheckpointingHook\(path=\.\.\.\)"
    with pytest.raises(CheckpointError, match=no_room):
        trainer.train()
    assert steps.inodes is None  # no step was taken


def test_allocate_takes_the_blocks_without_writing(tmp_path: Path) -> None:
    from trainfsm.checkpoint.disk import allocate

    if not Path("/proc/self/io").is_file():
        pytest.skip("no /proc/self/io: this process's bytes written cannot be read")
    before = written_by_this_process()
    assert allocate(tmp_path, [("a.pt", 3 << 20), ("b.pt", 1 << 20)]) == 4 << 20
    assert written_by_this_process() - before < 4096
    for name, size in (("a.pt", 3 << 20), ("b.pt", 1 << 20)):
        stat = (tmp_path / name).stat()
        assert stat.st_size == size and stat.st_blocks * 512 >= size


def test_where_nothing_can_be_allocated_the_free_space_is_checked(tmp_path: Path) -> None:
    import errno

    from trainfsm.checkpoint.disk import _check_free

    assert _check_free(tmp_path, 1 << 20) == 0
    with pytest.raises(OSError) as no_room:
        _check_free(tmp_path, 1 << 62)
    assert no_room.value.errno == errno.ENOSPC and "needed" in str(no_room.value)


def test_a_file_on_a_file_system_not_known_to_be_local_is_never_written_over() -> None:
    # Its other readers may be on other hosts (NFS, Lustre, ...), where this host's leases see nothing.
    from trainfsm.checkpoint.disk import file_system, unshared

    if not Path("/proc/self/status").is_file():
        pytest.skip("no procfs here")
    assert file_system(Path("/proc/self/status")) is None
    assert not unshared(Path("/proc/self/status"))


def test_where_sharing_cannot_be_known_only_the_stores_own_reserved_files_are_written_over(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # As on NFS: no lease tells whether another host has a pruned file open. The files RESTORE
    # reserved were seen by no one, so the first saves still write over them; pruned files are deleted.
    from trainfsm.checkpoint import recycling

    monkeypatch.setattr(recycling, "unshared", lambda path: False)
    store = CheckpointStore(tmp_path)
    store.reserve({"model": LARGE * 4}, copies=2)
    reserved = set(recycled(tmp_path))
    saved = []
    for step in (1, 2, 3):
        checkpoint, _, _ = store.save(step, state(step), keep=False)
        saved.append(inode(checkpoint.path / "model.pt"))
        store.prune(keep_previous=0)
        assert recycled(tmp_path).keys() <= reserved  # a pruned file is deleted, not kept
    assert len(reserved) == 2 and set(saved[:2]) == reserved
    store.close()


@pytest.mark.parametrize(("start", "held"), [(6, 3), (2, 1)], ids=["resumed from the newest", "a rollback to 2"])
def test_a_restarts_room_counts_only_the_checkpoints_its_run_will_prune(tmp_path: Path, start: int, held: int) -> None:
    # A rollback's saves abandon 4 and 6, which pruning then never frees: they are no room for its saves.
    model = {"model": torch.zeros(RECYCLED_BYTES // 4)}  # one large file a checkpoint
    first = CheckpointStore(tmp_path, direct_io=False)
    for step in (2, 4, 6):
        first.save(step, model, keep=False)
    first.close()
    file = (tmp_path / "6" / "model.pt").stat().st_size
    restart = CheckpointStore(tmp_path, direct_io=False)
    restart.resumed_from(start)
    reserved = restart.reserve({"model": file}, copies=4)
    restart.close()
    assert (reserved.bytes, reserved.allocated) == (0, (4 - held) * file)
