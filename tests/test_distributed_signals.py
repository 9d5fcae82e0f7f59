"""Agreement across ranks: a signal that reached one rank stops both at the same step, without a hang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.faults.two_ranks import events, scenario

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux"),
    pytest.mark.distributed,
    pytest.mark.faults,
]


@pytest.mark.parametrize(
    "agree", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["per_step_agreement", "loss_none_agreement"]
)
def test_signal_to_rank_1_only_makes_both_ranks_save_at_the_same_step_and_exit(tmp_path: Path, agree: bool) -> None:
    result = scenario(tmp_path, timeout=90, agree=agree)
    assert not result["hung"], f"rank(s) {result['hung']} hung; stderr: {result['stderr']}"
    assert result["codes"] == {0: 138, 1: 138}, result["stderr"]
    agreed = {rank: [e for e in events(tmp_path, rank) if e["event"] == "signal_agreed"] for rank in (0, 1)}
    assert len(agreed[0]) == len(agreed[1]) == 1
    step = agreed[0][0]["agreed_step"]
    assert agreed[1][0]["agreed_step"] == step
    received = {rank: [e for e in events(tmp_path, rank) if e["event"] == "signal_received"] for rank in (0, 1)}
    assert received[0] == [] and len(received[1]) == 1  # only rank 1 got it; rank 0 learned it by all-reduce
    saved = [e for e in events(tmp_path, 0) if e["event"] == "checkpoint_saved"]
    assert [e["saved_step"] for e in saved] == [step]
    assert (tmp_path / "checkpoints" / str(step) / "manifest.json").is_file()
    for rank in (0, 1):
        exits = [e for e in events(tmp_path, rank) if e["event"] == "exit"]
        assert [(e["reason"], e["code"], e["step"]) for e in exits] == [("preempted", 138, step)]


@pytest.mark.slow
def test_a_signal_with_async_sharded_saves_exits_after_the_sharded_checkpoint_is_durable(tmp_path: Path) -> None:
    """FSDP2 and ``async_save``: the signal's checkpoint is written on each rank's writer thread;
    EXIT waits for it, so both ranks exit 138 with a complete sharded checkpoint of the agreed step."""
    result = scenario(tmp_path, timeout=90, fsdp_async=True)
    assert not result["hung"], f"rank(s) {result['hung']} hung; stderr: {result['stderr']}"
    assert result["codes"] == {0: 138, 1: 138}, result["stderr"]
    [agreed] = [e for e in events(tmp_path, 0) if e["event"] == "signal_agreed"]
    step = agreed["agreed_step"]
    [saved] = [e for e in events(tmp_path, 0) if e["event"] == "checkpoint_saved"]
    assert (saved["saved_step"], saved["asynchronous"], saved["sharded"]) == (step, True, True)
    checkpoint = tmp_path / "checkpoints" / str(step)
    assert (checkpoint / "manifest.json").is_file()
    assert sorted(p.name for p in (checkpoint / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (tmp_path / "checkpoints" / "latest").resolve() == checkpoint.resolve()
    for rank in (0, 1):
        exits = [e for e in events(tmp_path, rank) if e["event"] == "exit"]
        assert [(e["reason"], e["code"], e["step"]) for e in exits] == [("preempted", 138, step)]


def test_with_a_default_group_like_nccls_the_step_agreement_runs_in_the_gloo_host_group(tmp_path: Path) -> None:
    """Under NCCL the default group's flag would be a GPU tensor read after every optimizer step (a
    device sync): the step-end agreement runs in the trainer's gloo host group, once per step, and
    both ranks still agree on the same step."""
    result = scenario(tmp_path, timeout=90, host_group=True)
    assert not result["hung"], f"rank(s) {result['hung']} hung; stderr: {result['stderr']}"
    assert result["codes"] == {0: 138, 1: 138}, result["stderr"]
    agreed = {
        rank: [e["agreed_step"] for e in events(tmp_path, rank) if e["event"] == "signal_agreed"] for rank in (0, 1)
    }
    assert len(agreed[0]) == 1 and agreed[0] == agreed[1]
    for rank in (0, 1):
        groups = json.loads((tmp_path / f"async_all_reduces.rank{rank}.json").read_text())
        assert groups == ["gloo"] * agreed[rank][0]  # one per step, none in the default group
