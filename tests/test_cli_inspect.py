"""``trainfsm inspect``: a real checkpoint verifies and shows its contents; damaged ones fail by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli_helpers import TinyTrainer, cli, run
from trainfsm import BaseHook, CheckpointingHook


class CountingHook(BaseHook):
    """A hook with resumable state, so the checkpoint has a hooks.pt."""

    def on_state_dict(self, trainer: Any, state_dict: dict[str, Any]) -> None:
        state_dict["counting"] = {"seen": trainer.step, "buffer": torch.zeros(2, 5, dtype=torch.float16)}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    run(tmp_path, steps=4, interval=2, hooks=[CountingHook()])
    return tmp_path / "checkpoints" / "4"


def test_inspect_verifies_and_prints_the_contents(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "inspect", checkpoint)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"checkpoint {checkpoint}"
    assert lines[1] == "verified: manifest format 5, 3 files, sizes and xxh3_128 checksums match"
    assert lines[2].startswith("step 4, kept: no, created ")
    assert "trainfsm 0.1.0" in lines[3] and f"torch {torch.__version__}" in lines[3]
    for name in ("manifest.json", "model.pt", "training_state.pt", "hooks.pt"):
        assert any(line.strip().startswith(name) for line in lines), name
    digest = json.loads((checkpoint / "manifest.json").read_text())["files"]["model.pt"]["digest"]
    assert any(line.split()[:1] == ["model.pt"] and line.endswith(f"xxh3_128 {digest[:16]}...") for line in lines)
    model = [line.split() for line in lines if line.startswith("  weight") or line.startswith("  bias")]
    assert model == [["weight", "(1,", "3)", "float32"], ["bias", "(1,)", "float32"]]
    assert "model (model.pt): 2 entries, 4 values, 16 B" in out
    assert "training state (training_state.pt): step 4, epoch 0" in out
    assert "param group 0: 2 parameters; lr=0.1, momentum=0" in out
    assert "lr_scheduler: none" in out
    assert "ranks: 1 (keys rng, data, loss_none_skips)" in out
    assert "  data: epoch 0 micro-batch 4 (every rank)" in out
    assert "    global: unknown (list draws no torch DistributedSampler" in out  # the run's batches are a list
    assert "hooks (hooks.pt): counting" in out
    assert "counting: {seen, buffer}" in out


def test_inspect_finds_the_latest_checkpoint_of_a_store_or_a_workspace(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = checkpoint.parent.parent
    code, out, _ = cli(capsys, "inspect", workspace)
    assert code == 0 and out.splitlines()[0] == f"checkpoint {checkpoint}  (from {workspace}: checkpoints/latest)"
    code, out, _ = cli(capsys, "inspect", checkpoint.parent)
    assert code == 0 and out.splitlines()[0] == f"checkpoint {checkpoint}  (from {checkpoint.parent}: latest)"


def test_a_corrupted_file_fails_its_checksum(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    model.write_bytes(bytes(data))
    code, out, err = cli(capsys, "inspect", checkpoint)
    assert code == 1 and out == ""
    assert f"INVALID: {model} does not match its xxh3_128 in manifest.json (corrupted)" in err


def test_a_truncated_file_fails_its_size(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = checkpoint / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    code, _, err = cli(capsys, "inspect", checkpoint)
    assert code == 1 and f"{state} has 100 bytes, the manifest says" in err


def test_a_missing_manifest_is_an_incomplete_checkpoint(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (checkpoint / "manifest.json").unlink()
    code, _, err = cli(capsys, "inspect", checkpoint)
    assert code == 1 and "is not a trainfsm checkpoint: it has no manifest.json" in err


def test_a_manifest_of_an_unknown_format_is_invalid(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = checkpoint / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": 99}))
    code, _, err = cli(capsys, "inspect", checkpoint)
    assert code == 1 and "unknown format 99" in err


def test_no_checkpoint_at_the_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "inspect", tmp_path / "nowhere")
    assert code == 2 and "no such directory" in err
    code, _, err = cli(capsys, "inspect", tmp_path)
    assert code == 2 and "not a checkpoint" in err


def sharded_run(workspace: Path, steps: int) -> None:
    TinyTrainer(max_steps=steps, workspace=workspace, hooks=[CheckpointingHook(interval=2, sharded=True)]).train()


def test_inspect_verifies_a_sharded_checkpoint_and_lists_its_keys_without_a_process_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sharded_run(tmp_path, steps=4)
    checkpoint = tmp_path / "checkpoints" / "4"
    code, out, err = cli(capsys, "inspect", checkpoint)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == "verified: manifest format 5, 3 files, sizes and xxh3_128 checksums match"
    shards = [line.split() for line in lines if line.strip().startswith("sharded/")]
    assert [(s[0], s[-2:]) for s in shards] == [
        ("sharded/.metadata", ["rank", "0"]), ("sharded/__0_0.distcp", ["rank", "0"]),
    ]  # fmt: skip
    assert "sharded (torch.distributed.checkpoint), written by 1 rank: model and optimizer" in out
    assert "model (sharded/): 2 entries, 4 values, 16 B" in out
    model = [line.split() for line in lines if line.startswith("  weight") or line.startswith("  bias")]
    assert model == [["weight", "(1,", "3)", "float32"], ["bias", "(1,)", "float32"]]
    assert "training state (training_state.pt): step 4, epoch 0" in out
    assert "optimizer: None" not in out


def test_inspect_names_a_corrupted_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sharded_run(tmp_path, steps=2)
    shard = tmp_path / "checkpoints" / "2" / "sharded" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + b"?")
    code, _, err = cli(capsys, "inspect", tmp_path / "checkpoints" / "2")
    assert code != 0 and "__0_0.distcp does not match its xxh3_128" in err
