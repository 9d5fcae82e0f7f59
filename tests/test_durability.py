"""Durability, tested rather than claimed: every state a power cut may leave during a save loads.

A SIGKILL keeps the page cache, so kill tests cannot see a missing fsync; only a power cut can.
``tests/crashfs.py`` records the file-system operations of a real save of step 2 over a store
holding step 1 (``keep_previous=0``, so the save also prunes step 1) and builds every crash state
POSIX allows. On each, ``load="latest"`` (newest complete checkpoint first, skipping any that
fails verification) must give step 1 or the complete step 2, byte for byte, never an error and
never nothing. The second half of the module removes each fsync of the protocol from the recorded
trace (as if the code did not make it) and shows that the check then finds a state that loses both.
The last part records a step saved again (a run resumed from step 4 saves step 5 over the old one):
after a kill or a power cut at any point, RESTORE's clean-up leaves a complete step 5, the new one
wherever it was complete before the kill.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import crashfs
from trainfsm.checkpoint import recycling, writemode
from trainfsm.checkpoint.store import CheckpointError, CheckpointStore

pytestmark = pytest.mark.faults


def parts(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(300, generator=generator), "b": torch.randn(3, generator=generator)},
        "training_state": {"step": step, "epoch": 0},
    }


def newest_loadable(root: Path) -> tuple[int, dict[str, Any]] | None:
    """What CheckpointingHook(load="latest") resumes from: the newest checkpoint that verifies."""
    store = CheckpointStore(root)
    for candidate in store.candidates():
        try:
            manifest = CheckpointStore.verify(candidate.path)
            return candidate.step, CheckpointStore.load(candidate.path, manifest)
        except CheckpointError:
            continue
    return None


def same(loaded: dict[str, Any], expected: dict[str, Any]) -> bool:
    model, want = loaded["model"], expected["model"]
    return (
        model.keys() == want.keys()
        and all(torch.equal(model[k], want[k]) for k in want)
        and loaded["training_state"] == expected["training_state"]
    )


@pytest.fixture(
    scope="module", params=[False, True, "auto", "recycled"], ids=["page-cache", "o-direct", "chosen", "recycled"]
)
def trace(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> crashfs.Trace:
    """The operations of saving step 2 (then pruning step 1) over a store that holds step 1, with
    the writer going through the page cache (``direct_io=False``), past it (``True``, where the
    file system allows it: its last buffer is padded, then the file is cut back), or the way the
    store measured to be faster here (``"auto"``, the default). The store is prepared first, as
    CheckpointingHook does in RESTORE: the measurement's probe files are not part of a save.

    ``"recycled"``: the way measured, and the store also keeps a pruned step 0's files, which the
    save writes over (moved into its directory, written from the start and cut to size) and
    ``close`` deletes; every file counts as large enough to recycle."""
    recycled = request.param == "recycled"
    root = tmp_path_factory.mktemp("store") / "checkpoints"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writemode, "RECHECK_SECONDS", float("inf"))  # no re-check's probe inside the save
        if recycled:
            patch.setattr(recycling, "RECYCLED_BYTES", 0)
            previous = CheckpointStore(root)
            larger = {"model": {"w": torch.randn(2000)}, "training_state": {"step": 0, "pad": "x" * 3000}}
            previous.save(0, larger, keep=False)  # both its files are cut back when written over
            previous.save(1, parts(1), keep=False)
            previous.prune(0)
            assert len(list((root / recycling.RECYCLE).iterdir())) == 2
        else:
            CheckpointStore(root).save(1, parts(1), keep=False)
        store = CheckpointStore(root, direct_io="auto" if recycled else request.param)
        store.prepare()

        def save_and_prune() -> None:
            store.save(2, parts(2), keep=False)
            store.prune(0)
            store.close()

        return crashfs.record(root, save_and_prune)


def full_save_problem(found: tuple[int, dict[str, Any]]) -> str:
    step, loaded = found
    return "" if same(loaded, parts(step)) else f"step {step} loads with other contents"


def sharded_save_problem(found: tuple[int, dict[str, Any]]) -> str:
    step, loaded = found  # verified: every rank's shards match the manifest
    return "" if loaded["training_state"]["step"] == step else f"step {step} holds another step's state"


def failures(
    trace: crashfs.Trace, scratch: Path, problem: Any = full_save_problem, limit: int = 3
) -> tuple[int, list[str]]:
    """(states checked, up to ``limit`` descriptions of states that load neither step 1 nor step 2)."""
    bad: list[str] = []
    count = 0
    for description, tree, data in crashfs.crash_states(trace):
        count += 1
        directory = scratch / f"state{count}"
        crashfs.materialize(tree, data, directory)
        try:
            found = newest_loadable(directory)
        except Exception as exc:  # anything but CheckpointError (which the loader skips) is a failure
            bad.append(f"{description}: {type(exc).__name__}: {exc}")
        else:
            what = "no checkpoint loads" if found is None else problem(found)
            if what:
                bad.append(f"{description}: {what}")
        shutil.rmtree(directory)
        if len(bad) >= limit:
            break
    return count, bad


def test_the_recorded_save_is_the_protocol(trace: crashfs.Trace) -> None:
    kinds = [op[0] for op in trace.ops]
    assert kinds[0] == "mkdir" and "rename" in kinds and "symlink" in kinds and "rmdir" in kinds
    assert kinds.count("fsync_file") == 3  # model.pt, training_state.pt, manifest.json
    recycled = recycling.RECYCLE in trace.initial  # its directory is synced too: files moved out of it
    assert (
        kinds.count("fsync_dir") == 3 + recycled
    )  # the temporary directory, the root after the rename and after latest
    into_place = [i for i, op in enumerate(trace.ops) if op[0] == "rename" and op[1].startswith(".tmp-2-")]
    assert len(into_place) == 1 and into_place[0] > max(i for i, k in enumerate(kinds) if k == "fsync_file")


def test_a_save_writes_over_kept_files_where_there_are_some(trace: crashfs.Trace) -> None:
    if recycling.RECYCLE not in trace.initial:
        assert not [op for op in trace.ops if op[0] == "rename" and op[1].startswith(recycling.RECYCLE)]
        return
    moved = [op for op in trace.ops if op[0] == "rename" and op[1].startswith(".tmp-recycle/")]
    assert sorted(op[2].rsplit("/", 1)[1] for op in moved) == ["model.pt", "training_state.pt"]
    assert not [op for op in trace.ops if op[0] == "create" and op[1].endswith(".pt")]  # no new file
    recycled = {trace.initial[op[1]][1] for op in moved}
    cut = [op for op in trace.ops if op[0] == "truncate" and op[1] in recycled and op[2] < len(trace.data[op[1]])]
    assert cut  # step 0's larger model file, cut to the size of what was written over it


def test_every_crash_state_of_a_save_loads_the_previous_or_the_new_checkpoint(
    trace: crashfs.Trace, tmp_path: Path
) -> None:
    count, bad = failures(trace, tmp_path)
    assert not bad, "\n".join(bad)
    # every prefix, with the pending operations lost one by one and together: 89 states through the
    # page cache, 104 with O_DIRECT's padding cut back (20 and 22 operations); "auto" is one of them
    assert count > 4 * len(trace.ops)


def _without(trace: crashfs.Trace, drop: Any) -> crashfs.Trace:
    """The trace as a protocol without the fsyncs ``drop(index, op)`` selects would have made it."""
    ops = [op for index, op in enumerate(trace.ops) if not drop(index, op)]
    return crashfs.Trace(trace.initial, trace.data, ops)


def _fsyncs(trace: crashfs.Trace, kind: str) -> list[int]:
    return [i for i, op in enumerate(trace.ops) if op[0] == kind]


@pytest.mark.parametrize(
    "which",
    [
        "model.pt data",
        "training_state.pt data",
        "manifest data",
        "temporary directory",
        "root, both",
        "recycled files' directory",
    ],
)
def test_without_any_one_fsync_of_the_protocol_a_crash_state_loses_both_checkpoints(
    trace: crashfs.Trace, tmp_path: Path, which: str
) -> None:
    files = _fsyncs(trace, "fsync_file")  # in the order the files are written
    dirs = _fsyncs(trace, "fsync_dir")
    recycle = trace.initial.get(recycling.RECYCLE)
    recycle_syncs = {i for i in dirs if recycle is not None and trace.ops[i] == ("fsync_dir", recycle[1])}
    if which == "recycled files' directory" and recycle is None:
        # small files are deleted, not kept: the save and its prune make no such directory to sync
        assert not [op for op in trace.ops if op[0] == "mkdir" and op[1] == recycling.RECYCLE]
        return
    dirs = [i for i in dirs if i not in recycle_syncs]
    dropped = {
        "model.pt data": {files[0]},
        "training_state.pt data": {files[1]},
        "manifest data": {files[2]},
        "temporary directory": {dirs[0]},
        # The root is fsynced after the rename and again after `latest` moves; each covers the
        # rename for the other, so only without both is the new directory's name at risk.
        "root, both": {dirs[1], dirs[2]},
        "recycled files' directory": recycle_syncs,
    }[which]
    _, bad = failures(_without(trace, lambda index, op: index in dropped), tmp_path, limit=1)
    assert bad, f"no crash state loses both checkpoints without the fsync of the {which}"


# ---------------------------------------------------------------- sharded saves
@pytest.fixture(scope="module")
def sharded_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[crashfs.Trace, dict[int, int]]:
    """A trainer's sharded save of step 2 (DCP's shards and .metadata, then training_state.pt and
    the manifest), pruning step 1; and the step each checkpoint's training state holds."""
    from tests.test_checkpointing import run

    workspace = tmp_path_factory.mktemp("sharded")
    run(workspace, 1, interval=1, sharded=True)
    root = workspace / "checkpoints"
    trace = crashfs.record(root, lambda: run(workspace, 2, interval=1, sharded=True, keep_previous=0))
    return trace, {1: 1, 2: 2}


def test_every_crash_state_of_a_sharded_save_loads_the_previous_or_the_new_checkpoint(
    sharded_trace: tuple[crashfs.Trace, dict[int, int]], tmp_path: Path
) -> None:
    trace, _ = sharded_trace
    written = [op[1] for op in trace.ops if op[0] == "create"]
    assert any(path.endswith(".distcp") for path in written) and any(".metadata" in path for path in written)
    count, bad = failures(trace, tmp_path, sharded_save_problem)
    assert not bad, "\n".join(bad)
    assert count > 100


@pytest.mark.parametrize("which", ["a shard's data", "the shards' directory", "training_state.pt data"])
def test_without_a_fsync_of_the_sharded_protocol_a_crash_state_loses_both(
    sharded_trace: tuple[crashfs.Trace, dict[int, int]], tmp_path: Path, which: str
) -> None:
    trace, _ = sharded_trace
    created = {op[2]: op[1] for op in trace.ops if op[0] == "create"}
    made = {op[2]: op[1] for op in trace.ops if op[0] == "mkdir"}

    def fsync_of(predicate: Any) -> set[int]:
        names = {**created, **made}
        return {i for i, op in enumerate(trace.ops) if op[0].startswith("fsync") and predicate(names.get(op[1], ""))}

    dropped = {
        "a shard's data": fsync_of(lambda path: path.endswith(".distcp")),
        "the shards' directory": fsync_of(lambda path: path.endswith("/sharded")),
        "training_state.pt data": fsync_of(lambda path: path.endswith("training_state.pt")),
    }[which]
    assert dropped, f"the save made no fsync of {which}"
    _, bad = failures(_without(trace, lambda index, op: index in dropped), tmp_path, sharded_save_problem, limit=1)
    assert bad, f"no crash state loses both checkpoints without the fsync of {which}"


# ---------------------------------------------------------------- a step saved again
@pytest.fixture(scope="module")
def resave_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[crashfs.Trace, dict[str, str]]:
    """A run resumed from step 4 (``load="4"``) that saves step 5 again, over the step 5 of the run
    it rolled back (``keep_previous=1``: steps 4 and 5 on disk), as recorded; and the manifest
    checksums of the two step-5 saves, ``"old"`` and ``"new"``."""
    from tests.test_checkpointing import events, run

    workspace = tmp_path_factory.mktemp("resave")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writemode, "RECHECK_SECONDS", float("inf"))  # no re-check's probe inside the save
        run(workspace, 5, interval=1, keep_previous=1)
        trace = crashfs.record(
            workspace / "checkpoints", lambda: run(workspace, 5, interval=1, keep_previous=1, load="4")
        )
    old, new = (e["checksum"] for e in events(workspace, "checkpoint_saved") if e["saved_step"] == 5)
    return trace, {"old": old, "new": new}


def _replacement(trace: crashfs.Trace) -> range:
    """The kill points of the re-save from the new copy's completion on: after each operation from
    the new manifest's fsync to the end of the run (its prune and EXIT included)."""
    manifest_synced = max(i for i, op in enumerate(trace.ops) if op[0] == "fsync_file")
    return range(manifest_synced + 1, len(trace.ops) + 1)


def test_a_resave_killed_at_any_point_of_its_replacement_resumes_from_the_new_step(
    resave_trace: tuple[crashfs.Trace, dict[str, str]], tmp_path: Path
) -> None:
    """A SIGKILL keeps the page cache: a kill after the k-th operation leaves all k applied. Once
    the new step 5 is complete, a resumed run (RESTORE's clean-up, then ``load="latest"``) loads
    it, whatever point of the old copy's replacement the kill came at."""
    from tests.test_checkpointing import Trainer, events
    from trainfsm import CheckpointingHook

    trace, checksums = resave_trace
    moved = [op for op in trace.ops if op[0] == "rename" and op[2] == "5"]
    assert moved, "the recorded run saved no step 5 over the old one"
    loaded = {}
    for k in _replacement(trace):
        workspace = tmp_path / f"killed{k}"
        crashfs.materialize(*crashfs.killed_after(trace, k), workspace / "checkpoints")
        Trainer(CheckpointingHook(interval=1, keep_previous=1), max_steps=5, workspace=workspace).train()
        (event,) = events(workspace, "checkpoint_loaded")
        loaded[k] = (event["from_step"], event["checksum"] == checksums["new"])
        CheckpointStore.verify(workspace / "checkpoints" / "5")  # a complete step 5 stays on disk
    assert set(loaded.values()) == {(5, True)}, loaded


def test_every_crash_state_of_a_resave_keeps_a_complete_step(
    resave_trace: tuple[crashfs.Trace, dict[str, str]], tmp_path: Path
) -> None:
    """A power cut at any point of the re-save: RESTORE's clean-up (``remove_leftovers``) leaves a
    step 5 that verifies, the old one or the new one."""
    trace, _ = resave_trace
    count, bad = 0, []
    for description, tree, data in crashfs.crash_states(trace):
        count += 1
        directory = tmp_path / f"state{count}"
        crashfs.materialize(tree, data, directory)
        CheckpointStore(directory).remove_leftovers()
        found = newest_loadable(directory)
        if found is None or found[0] != 5:
            bad.append(f"{description}: {'nothing' if found is None else f'step {found[0]}'} loads")
        shutil.rmtree(directory)
        if len(bad) >= 3:
            break
    assert not bad, "\n".join(bad)
    assert count > 4 * len(trace.ops)
