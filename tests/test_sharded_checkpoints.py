"""Sharded checkpoints (``CheckpointingHook(sharded=...)``, torch.distributed.checkpoint).

On one process without a process group (``sharded=True``): the layout, the manifest's sums,
exact resume, what ``CheckpointStore.load`` and ``trainfsm inspect`` make of it, and the DCP
files that would run code. On 2 real gloo ranks with FSDP2 ``fully_shard`` (``sharded="auto"``):
every rank's files in one manifest, exact resume, a corrupted shard skipped alike on every
rank, a rank killed in the middle of a save, resharding to one process, ``sharded=False``,
``async_save`` (exact resume; a background failure raised on every rank alike); and a full DDP
checkpoint resumed on another world size (2 -> 1 and 1 -> 2).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xxhash

from tests.distributed import sharded_worker
from tests.distributed.launch import ROOT, audit_problems, events, free_port, run_command, run_worker, summary
from tests.test_checkpointing import Trainer, params, run
from tests.test_checkpointing import events as trail
from trainfsm import CheckpointError, CheckpointingHook
from trainfsm.checkpoint.store import CheckpointStore

WORKER = Path(sharded_worker.__file__)
WORLD = 2
distributed = pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux")


def file_sum(path: Path, checksum: str = "xxh3_128") -> str:
    """The file's checksum as its manifest entry holds it ("digest"): xxh3_128 by default."""
    return (hashlib.sha256 if checksum == "sha256" else xxhash.xxh3_128)(path.read_bytes()).hexdigest()


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_sharded_must_be_true_false_or_auto(value: Any) -> None:
    with pytest.raises(ValueError, match=r"sharded must be True, False or 'auto'.*got " + repr(value)):
        CheckpointingHook(interval=1, sharded=value)


def test_auto_keeps_full_checkpoints_for_a_model_that_is_not_split(tmp_path: Path) -> None:
    run(tmp_path, 4)  # sharded="auto" by default
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "4").iterdir()) == [
        "manifest.json", "model.pt", "training_state.pt",
    ]  # fmt: skip
    [saved] = trail(tmp_path, "checkpoint_saved")
    assert saved["sharded"] is False


# ---------------------------------------------------------------- one process, sharded=True
def test_sharded_save_writes_dcp_files_beside_training_state_and_lists_them_in_the_manifest(tmp_path: Path) -> None:
    run(tmp_path, 4, sharded=True)
    checkpoint = tmp_path / "checkpoints" / "4"
    on_disk = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    assert on_disk == [
        "manifest.json", "sharded/.metadata", "sharded/__0_0.distcp", "training_state.pt",
    ]  # fmt: skip
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (manifest["format"], manifest["sharded"], manifest["world_size"]) == (5, True, 1)
    assert sorted(manifest["files"]) == on_disk[1:]
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (checkpoint / name).stat().st_size
        assert entry["digest"] == file_sum(checkpoint / name)
    assert manifest["files"]["sharded/__0_0.distcp"]["rank"] == 0
    [saved] = trail(tmp_path, "checkpoint_saved")
    assert saved["sharded"] is True and saved["world_size"] == 1
    assert saved["bytes"] == sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def test_a_sharded_save_uses_the_hooks_checksum_for_every_file(tmp_path: Path) -> None:
    run(tmp_path, 4, sharded=True, checksum="sha256")
    checkpoint = tmp_path / "checkpoints" / "4"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["checksum"] == "sha256"
    for name, entry in manifest["files"].items():  # the shards DCP wrote, described by the same hash
        assert entry["digest"] == file_sum(checkpoint / name, "sha256")
    resumed = run(tmp_path, 8, sharded=True)  # an xxh3_128 hook loads it, verifying sha256
    assert resumed.step == 8 and trail(tmp_path, "checkpoint_loaded")[0]["from_step"] == 4


def test_sharded_resume_on_one_process_is_exact(tmp_path: Path) -> None:
    straight = run(tmp_path / "straight", 8, sharded=True)
    run(tmp_path / "resumed", 4, sharded=True)
    resumed = run(tmp_path / "resumed", 8, sharded=True)
    assert equal(params(straight), params(resumed))
    [loaded] = trail(tmp_path / "resumed", "checkpoint_loaded")
    assert (loaded["from_step"], loaded["sharded"], loaded["saved_world_size"]) == (4, True, 1)


def test_async_sharded_saves_write_the_same_files_in_the_background_and_resume_exactly(tmp_path: Path) -> None:
    straight = run(tmp_path / "straight", 8, sharded=True)
    run(tmp_path / "resumed", 4, sharded=True, async_save=True)
    resumed = run(tmp_path / "resumed", 8, sharded=True, async_save=True)
    assert equal(params(straight), params(resumed))
    saved = trail(tmp_path / "resumed", "checkpoint_saved")
    assert [(e["saved_step"], e["asynchronous"], e["sharded"]) for e in saved] == [(4, True, True), (8, True, True)]
    assert all(e["blocked_seconds"] >= 0 for e in saved)
    checkpoint = tmp_path / "resumed" / "checkpoints" / "8"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["sharded/.metadata", "sharded/__0_0.distcp", "training_state.pt"]
    for name, entry in manifest["files"].items():
        assert entry["digest"] == file_sum(checkpoint / name)


def test_a_staged_shard_is_the_cpu_copy_the_writer_fills_whatever_device_the_mesh_has() -> None:
    """An async save stages a DTensor as a DTensor over a CPU tensor that the writer thread fills
    later. On a mesh of another device (CUDA on a GPU machine; "meta" here) ``DTensor.from_local``
    would move that tensor to the mesh's device, and DCP would write a copy the writer never filled."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from trainfsm.checkpoint.background import stage as _stage

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("meta", [0])
        shard = DTensor.from_local(torch.empty(3, 2, device="meta"), mesh, [Shard(0)], run_check=False)
        staged, copies = _stage({"optimizer": {"exp_avg": shard}}, SimpleNamespace(model=None))  # type: ignore[arg-type]
        [(source, target)] = copies
        written = staged["optimizer"]["exp_avg"]
        assert source.device.type == "meta" and target.device.type == "cpu"
        assert written.to_local().data_ptr() == target.data_ptr()
        assert (written.device_mesh, written.placements, written.shape) == (mesh, (Shard(0),), shard.shape)
    finally:
        dist.destroy_process_group()


def test_a_sharded_checkpoint_loads_whatever_sharded_says_now(tmp_path: Path) -> None:
    run(tmp_path, 4, sharded=True)
    resumed = run(tmp_path, 4, sharded=False)  # at max_steps already: loads and exits
    assert resumed.step == 4 and trail(tmp_path, "checkpoint_loaded")[-1]["sharded"] is True


def test_store_load_of_a_sharded_checkpoint_returns_the_torch_files_only(tmp_path: Path) -> None:
    run(tmp_path, 4, sharded=True)
    parts = CheckpointStore.load(tmp_path / "checkpoints" / "4")
    assert sorted(parts) == ["training_state"]
    assert parts["training_state"]["step"] == 4 and "optimizer" not in parts["training_state"]


def test_a_corrupted_shard_is_skipped_for_the_previous_checkpoint(tmp_path: Path) -> None:
    run(tmp_path, 8, sharded=True, keep_previous=1)
    shard = tmp_path / "checkpoints" / "8" / "sharded" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1
    shard.write_bytes(bytes(data))
    run(tmp_path, 8, sharded=True, keep_previous=1)
    [skipped] = trail(tmp_path, "checkpoint_skipped")
    assert skipped["path"].endswith("checkpoints/8") and "__0_0.distcp does not match its xxh3_128" in skipped["reason"]
    assert trail(tmp_path, "checkpoint_loaded")[-1]["from_step"] == 4


def test_a_resumed_model_that_does_not_fit_names_every_mismatched_key(tmp_path: Path) -> None:
    run(tmp_path, 4, sharded=True)

    class Wider(Trainer):
        def build_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Dropout(0.3), torch.nn.Linear(9, 1))

    trainer = Wider(CheckpointingHook(interval=4, sharded=True), max_steps=6, workspace=tmp_path)
    with pytest.raises(CheckpointError, match=r"shape mismatch: 0.bias \(checkpoint \(8,\), model \(9,\)\)"):
        trainer.train()


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this must never run",))


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DCP itself unpickles .metadata with pickle.load; the hook reads it with an allow-list."""
    run(tmp_path, 4, sharded=True)
    checkpoint = tmp_path / "checkpoints" / "4"
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    manifest = json.loads((checkpoint / "manifest.json").read_text())  # a matching manifest: sums pass
    entry = manifest["files"]["sharded/.metadata"]
    entry.update(bytes=(checkpoint / "sharded" / ".metadata").stat().st_size)
    entry.update(digest=file_sum(checkpoint / "sharded" / ".metadata"))
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    trainer = Trainer(CheckpointingHook(interval=4, load="4"), max_steps=4, workspace=tmp_path)
    with pytest.raises(CheckpointError, match=r"refers to builtins.print.*not loaded \(it could run code\)"):
        trainer.train()
    assert "this must never run" not in capsys.readouterr().out


# ---------------------------------------------------------------- 2 gloo ranks, fully_shard
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """Three launches: one process saves a full checkpoint; 2 ranks run every FSDP/DDP case of
    ``sharded_worker.py fsdp``; one process resumes the 2-rank checkpoints. Per launch, per rank,
    per case: parameters after RESTORE and at the end, the step, or the error."""
    out = tmp_path_factory.mktemp("sharded")
    results: dict[str, list[dict[str, Any]]] = {}
    for scenario, world in (("world1_before", 1), ("fsdp", WORLD), ("world1_after", 1)):
        outcome = run_worker(scenario, out, 180, world=world, worker=WORKER)
        assert not outcome.hung and set(outcome.codes.values()) == {0}, outcome.describe()
        results[scenario] = [torch.load(out / f"{scenario}.rank{rank}.pt") for rank in range(world)]
    return out, results


@distributed
@pytest.mark.distributed
def test_every_rank_writes_its_shard_and_the_manifest_lists_all_of_them(runs: tuple[Path, Any]) -> None:
    out, _ = runs
    checkpoint = out / "resume" / "checkpoints" / "6"
    on_disk = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    assert on_disk == [
        "manifest.json", "sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "training_state.pt",
    ]  # fmt: skip
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (manifest["format"], manifest["sharded"], manifest["world_size"]) == (5, True, WORLD)
    assert {name: entry.get("rank") for name, entry in manifest["files"].items()} == {
        "sharded/.metadata": 0, "sharded/__0_0.distcp": 0, "sharded/__1_0.distcp": 1, "training_state.pt": None,
    }  # fmt: skip
    for name, entry in manifest["files"].items():
        assert (entry["bytes"], entry["digest"]) == ((checkpoint / name).stat().st_size, file_sum(checkpoint / name))
    ranks = torch.load(checkpoint / "training_state.pt", weights_only=True)["ranks"]
    assert len(ranks) == WORLD  # each rank's random state and data position
    saved = [e for e in events(out / "resume", 0) if e["event"] == "checkpoint_saved"]
    assert [(e["saved_step"], e["sharded"], e["world_size"]) for e in saved] == [(3, True, 2), (6, True, 2)]
    assert saved[-1]["bytes"] == sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    assert not [e for e in events(out / "resume", 1) if e["event"] == "checkpoint_saved"]  # rank 0 reports
    assert not list((out / "resume" / "checkpoints").glob(".tmp-*"))


@distributed
@pytest.mark.distributed
def test_sharded_resume_on_the_same_world_size_is_exact(runs: tuple[Path, Any]) -> None:
    out, results = runs
    for rank, result in enumerate(results["fsdp"]):
        first, resumed = result["first"], result["resumed"]
        assert first["error"] is None and resumed["error"] is None
        assert equal(resumed["restored"], first["params"])  # other initial weights, all replaced
        assert equal(resumed["params"], result["uninterrupted"]["params"]), f"rank {rank}"
        loaded = [e for e in events(out / "resume", rank) if e["event"] == "checkpoint_loaded"]
        assert [(e["from_step"], e["sharded"], e["saved_world_size"]) for e in loaded] == [(3, True, WORLD)]
    assert summary(events(out / "resume", 0)) == summary(events(out / "resume", 1))
    assert audit_problems(out / "resume") == []


@distributed
@pytest.mark.distributed
def test_async_sharded_saves_resume_exactly_on_the_same_world_size(runs: tuple[Path, Any]) -> None:
    """Each rank copies its shards to CPU and writes them on its writer thread (DTensors over CPU
    copies, collectives on the hook's own gloo group); the result resumes like a synchronous save."""
    out, results = runs
    for rank, result in enumerate(results["fsdp"]):
        assert result["async_first"]["error"] is None and result["async_resumed"]["error"] is None
        assert equal(result["async_resumed"]["restored"], result["async_first"]["params"])
        assert equal(result["async_resumed"]["params"], result["uninterrupted"]["params"]), f"rank {rank}"
    saved = [e for e in events(out / "async", 0) if e["event"] == "checkpoint_saved"]
    assert [(e["saved_step"], e["asynchronous"], e["sharded"], e["world_size"]) for e in saved] == [
        (3, True, True, WORLD), (6, True, True, WORLD),
    ]  # fmt: skip
    checkpoint = out / "async" / "checkpoints" / "6"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [
        "sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "training_state.pt",
    ]  # fmt: skip
    for name, entry in manifest["files"].items():
        assert entry["digest"] == file_sum(checkpoint / name)
    assert summary(events(out / "async", 0)) == summary(events(out / "async", 1))
    assert audit_problems(out / "async") == []


@distributed
@pytest.mark.distributed
def test_the_process_group_of_background_sharded_saves_is_destroyed_at_exit(runs: tuple[Path, Any]) -> None:
    """A group left alive would keep its gloo threads into interpreter shutdown (see torch_workarounds)."""
    _, results = runs
    for result in results["fsdp"]:
        before, after = result["async_gloo_threads"]
        assert before > 0 and after == before


@distributed
@pytest.mark.distributed
def test_a_failed_async_sharded_save_raises_on_every_rank_at_the_next_checkpoint(runs: tuple[Path, Any]) -> None:
    """Rank 1's step-4 files fail in the background: both ranks log checkpoint_failed once they see
    it (step 5 or 6, as fast as the writer was) and raise the same error at the checkpoint of step 6,
    not each at the step it happened to look; step 2 stays the newest checkpoint."""
    out, results = runs
    errors = {result["async_failed"]["error"] for result in results["fsdp"]}
    [error] = errors
    assert error.startswith("CheckpointError: asynchronous checkpoint save failed: CheckpointError: sharded checkpoint")
    assert "at step 4 was not saved (rank 1: OSError: [Errno 5] Input/output error" in error
    assert [result["async_failed"]["step"] for result in results["fsdp"]] == [6, 6]
    root = out / "async_failed" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["2", "latest"]
    assert (root / "latest").resolve().name == "2"
    for rank in range(WORLD):
        trail_events = events(out / "async_failed", rank)
        [failed] = [e for e in trail_events if e["event"] == "checkpoint_failed"]
        assert failed["step"] in (5, 6) and "rank 1: OSError" in failed["message"]


@distributed
@pytest.mark.distributed
def test_a_corrupted_shard_is_skipped_alike_on_every_rank(runs: tuple[Path, Any]) -> None:
    """Rank 1's shard of step 4 is corrupted: rank 1 finds it, and rank 0 skips step 4 as well."""
    out, results = runs
    for rank in range(WORLD):
        trail_events = [e for e in events(out / "corrupt", rank) if e["attempt"] == 1]
        [skipped] = [e for e in trail_events if e["event"] == "checkpoint_skipped"]
        assert skipped["path"].endswith("checkpoints/4")
        assert skipped["reason"].startswith("rank 1: ")
        assert "__1_0.distcp does not match its xxh3_128" in skipped["reason"]
        [loaded] = [e for e in trail_events if e["event"] == "checkpoint_loaded"]
        assert loaded["from_step"] == 2
        assert results["fsdp"][rank]["corrupt_resumed"]["error"] is None
    assert audit_problems(out / "corrupt") == []


@distributed
@pytest.mark.distributed
def test_sharded_false_refuses_a_split_model_state_on_every_rank_before_training(runs: tuple[Path, Any]) -> None:
    _, results = runs
    for result in results["fsdp"]:
        refused = result["refused"]
        assert refused["step"] == 0
        assert "sharded over ranks, but CheckpointingHook(sharded=False)" in refused["error"]
        assert "pass sharded='auto'" in refused["error"]


@distributed
@pytest.mark.distributed
def test_sharded_resume_with_a_stateless_optimizer(runs: tuple[Path, Any]) -> None:
    _, results = runs
    for result in results["fsdp"]:
        assert result["sgd_resumed"]["error"] is None
        assert equal(result["sgd_resumed"]["restored"], result["sgd_first"]["params"])


@distributed
@pytest.mark.distributed
def test_a_sharded_fsdp_checkpoint_of_2_ranks_resumes_on_1_process(runs: tuple[Path, Any]) -> None:
    """DCP reshards: the one process gets every rank's shards."""
    out, results = runs
    [after] = results["world1_after"]
    assert after["fsdp2to1"]["error"] is None and after["fsdp2to1"]["step"] == 8
    assert equal(after["fsdp2to1"]["restored"], results["fsdp"][0]["resumed"]["params"])
    [loaded] = [e for e in events(out / "fsdp2to1", 0) if e["event"] == "checkpoint_loaded"]
    assert (loaded["from_step"], loaded["saved_world_size"]) == (6, WORLD)


@distributed
@pytest.mark.distributed
def test_a_full_ddp_checkpoint_of_2_ranks_resumes_on_1_process(runs: tuple[Path, Any]) -> None:
    out, results = runs
    [after] = results["world1_after"]
    assert after["ddp2to1"]["error"] is None and after["ddp2to1"]["step"] == 5
    assert equal(after["ddp2to1"]["restored"], results["fsdp"][0]["ddp2to1"]["params"])
    assert not (out / "ddp2to1" / "checkpoints" / "3" / "sharded").exists()  # DDP's state is whole: full save
    [loaded] = [e for e in events(out / "ddp2to1", 0) if e["event"] == "checkpoint_loaded"]
    assert (loaded["from_step"], loaded["sharded"]) == (3, False)


@distributed
@pytest.mark.distributed
def test_a_full_checkpoint_of_1_process_resumes_on_2_ddp_ranks(runs: tuple[Path, Any]) -> None:
    out, results = runs
    [before] = results["world1_before"]
    for rank, result in enumerate(results["fsdp"]):
        assert result["ddp1to2"]["error"] is None and result["ddp1to2"]["step"] == 5
        assert equal(result["ddp1to2"]["restored"], before["ddp1to2"]["params"])
        loaded = [e for e in events(out / "ddp1to2", rank) if e["event"] == "checkpoint_loaded"]
        assert [e["from_step"] for e in loaded] == [3]
    assert equal(results["fsdp"][0]["ddp1to2"]["params"], results["fsdp"][1]["ddp1to2"]["params"])


@distributed
@pytest.mark.distributed
@pytest.mark.faults
@pytest.mark.parametrize(
    ("killed", "mode"),
    [
        (0, ""),
        pytest.param(0, "_async", marks=pytest.mark.slow),
        pytest.param(1, "", marks=pytest.mark.slow),
        pytest.param(1, "_async", marks=pytest.mark.slow),
    ],
)
def test_a_rank_killed_in_the_middle_of_a_sharded_save_leaves_no_checkpoint_that_loads(
    tmp_path: Path, killed: int, mode: str
) -> None:
    """Rank ``killed`` dies after the shards of step 4 are written, before the manifest (on the
    writer thread with ``_async``). Step 4 never becomes a checkpoint; the next launch removes what
    is left and resumes from step 2."""
    action = f"die_rank{killed}{mode}"
    outcome = run_worker("kill", tmp_path, 60, "--action", action, "--pg-timeout", "10", worker=WORKER)
    assert outcome.codes[killed] == 9 and outcome.codes[1 - killed] != 0 and not outcome.hung, outcome.describe()
    root = tmp_path / "kill" / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["2", "latest"]
    leftovers = sorted(p.name for p in root.glob(".tmp-4-*"))
    if killed == 0:  # nobody could clean up: the shards are there, without a manifest
        [leftover] = leftovers
        assert (root / leftover / "sharded" / "__1_0.distcp").is_file()
        assert not (root / leftover / "manifest.json").exists()
    else:  # rank 0 saw its peer go and removed the directory itself
        assert leftovers == []

    again = run_worker("kill", tmp_path, 60, worker=WORKER)
    assert set(again.codes.values()) == {0}, again.describe()
    assert not list(root.glob(".tmp-*"))
    for rank in range(WORLD):
        resumed = [e for e in events(tmp_path / "kill", rank) if e["attempt"] == 1]
        assert [e["from_step"] for e in resumed if e["event"] == "checkpoint_loaded"] == [2]
        removed = [e["names"] for e in resumed if e["event"] == "checkpoint_tmp_removed"]
        assert removed == ([leftovers] if rank == 0 and leftovers else [])


# ---------------------------------------------------------------- the example
@distributed
@pytest.mark.distributed
@pytest.mark.slow  # the 2-rank sharded checkpoints above resume on 1 process in the fast tier
def test_fsdp_sharded_example_saves_sharded_resumes_and_reshards_to_one_process(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    example = [str(ROOT / "examples" / "fsdp_sharded.py"), "--workspace", str(workspace), "--interval", "10"]
    torchrun = Path(sys.executable).with_name("torchrun")  # the console script, as a user runs it
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    two_ranks = [*launcher, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port"]
    for steps, extra in ((20, []), (30, ["--async-save"])):  # the resumed launch saves in the background
        code, output = run_command([*two_ranks, str(free_port()), *example, "--steps", str(steps), *extra], timeout=120)
        assert code == 0, output[-4000:]
    manifest = json.loads((workspace / "checkpoints" / "30" / "manifest.json").read_text())
    assert (manifest["sharded"], manifest["world_size"]) == (True, WORLD)
    assert sorted(p.name for p in (workspace / "checkpoints").iterdir()) == ["20", "30", "latest"]  # keep_previous=1
    code, output = run_command([sys.executable, *example, "--steps", "40"], timeout=120)
    assert code == 0, output[-4000:]
    for rank in range(WORLD):
        loaded = [(e["attempt"], e["from_step"]) for e in events(workspace, rank) if e["event"] == "checkpoint_loaded"]
        assert loaded == ([(1, 20), (2, 30)] if rank == 0 else [(1, 20)])
    saved = {e["saved_step"]: e for e in events(workspace, 0) if e["event"] == "checkpoint_saved"}
    assert [(step, saved[step]["asynchronous"], saved[step]["sharded"]) for step in (20, 30)] == [
        (20, False, True), (30, True, True),
    ]  # fmt: skip
    last = saved[40]
    assert last["sharded"] is False  # one process: the model is whole, saved as model.pt
    assert [e["reason"] for e in events(workspace, 0) if e["event"] == "exit"] == ["completed"] * 3
