"""DDP on 2 real gloo ranks: gradient accumulation with and without ``no_sync`` matches one process
on the concatenated batches, every rank ends with the same parameters, and ``loss=None`` warns."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import ROOT, audit_problems, events, free_port, run_command, run_worker, summary
from tests.distributed.worker import reference

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux"), pytest.mark.distributed]

STEPS, ACCUMULATION, WORLD, LR = 4, 3, 2, 0.1


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch of 2 ranks runs all three trainings (the scenario ``ddp`` of worker.py)."""
    out = tmp_path_factory.mktemp("ddp")
    outcome = run_worker("ddp", out, timeout=90)
    assert outcome.codes == {0: 0, 1: 0} and not outcome.hung, outcome.describe()
    return out, [torch.load(out / f"ddp.rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize(
    ("label", "allreduces"),
    [("no_sync", STEPS), ("sync_every_micro_batch", STEPS * ACCUMULATION)],
)
def test_accumulation_matches_one_process_on_the_concatenated_batches(
    ddp_run: tuple[Path, list[dict[str, Any]]], label: str, allreduces: int
) -> None:
    _, results = ddp_run
    expected = reference(STEPS, ACCUMULATION, WORLD, LR)
    rank0, rank1 = (r[label] for r in results)
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)  # all-reduced gradients: bit-identical parameters on every rank
    for got, want in zip(rank0["params"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The one-bucket model's gradient all-reduces DDP actually ran (counted by a comm hook):
    # once per optimizer step under no_sync, once per micro-batch without it.
    assert rank0["allreduces"] == rank1["allreduces"] == allreduces


def test_ranks_take_the_same_transitions(ddp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = ddp_run
    for label in ("no_sync", "sync_every_micro_batch", "loss_none"):
        trails = [summary(events(out / label, rank)) for rank in range(WORLD)]
        assert trails[0]["exit"] == [(trails[0]["steps"][-1], "completed", 0)]
        if label != "loss_none":  # loss_none: both ranks skipped the same micro-batch, so also equal
            assert trails[0]["steps"] == list(range(STEPS + 1))
        assert trails[0] == trails[1]
        assert audit_problems(out / label) == []


def test_loss_none_on_a_ddp_model_warns(ddp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = ddp_run
    for rank, result in enumerate(results):
        [(category, message, filename)] = result["loss_none"]["warnings"]
        assert category == "LossNoneWarning"
        assert "loss=None for a DDP/FSDP model" in message
        assert filename == "worker.py"  # points at the user's train() call, not at trainfsm
        skipped = [e for e in events(out / "loss_none", rank) if e["event"] == "loss_none"]
        assert [(e["step"], e["micro"]) for e in skipped] == [(2, 0)]
    for a, b in zip(results[0]["loss_none"]["params"], results[1]["loss_none"]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow  # examples/ddp.py runs under torchrun in the fast tier: test_torchrun_preemption.py
def test_example_runs_under_torchrun_with_agreeing_trails(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    torchrun = Path(sys.executable).with_name("torchrun")  # the console script, as a user runs it
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    argv = [
        *launcher, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(ROOT / "examples" / "ddp.py"), "--workspace", str(workspace),
        "--steps", "30", "--interval", "10", "--timeout", "30", "--loss-none-agreement",
    ]  # fmt: skip
    code, output = run_command(argv, timeout=120)
    assert code == 0, output[-4000:]
    trails = [events(workspace, rank) for rank in range(WORLD)]
    for rank, trail in enumerate(trails):
        start = next(e for e in trail if e["event"] == "run_start")
        assert (start["rank"], start["world_size"]) == (rank, WORLD)
    summaries = [summary(trail) for trail in trails]
    assert summaries[0]["exit"] == [(30, "completed", 0)]
    assert summaries[0]["checkpoint_steps"] == [10, 20, 30]
    assert summaries[0] == summaries[1]
    assert (workspace / "checkpoints" / "30" / "manifest.json").is_file()
    assert (workspace / "final.pt").is_file()
    assert audit_problems(workspace) == []
    starts = [next(e for e in trail if e["event"] == "run_start") for trail in trails]
    assert [start["config"]["loss_none_agreement"] for start in starts] == [True, True]
