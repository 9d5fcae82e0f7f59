"""examples/slurm/train.sbatch on the real cluster: signal, checkpoint, requeue, restart, exact resume."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
ARGS = ("--steps", "60", "--interval", "25", "--step-seconds", "0.05")


def events(workspace: Path) -> list[dict[str, Any]]:
    path = workspace / "logs" / "events.rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.05)


def uninterrupted(tmp_path: Path) -> dict[str, torch.Tensor]:
    workspace = tmp_path / "straight"
    command = [sys.executable, str(ROOT / "examples" / "slurm" / "train.py"), "--workspace", str(workspace), *ARGS]
    subprocess.run(command, check=True, capture_output=True, timeout=300, cwd=ROOT)
    return torch.load(workspace / "final.pt")  # type: ignore[no-any-return]


@pytest.mark.parametrize(("signal_name", "code"), [("USR1", 138), ("TERM", 143)])
def test_preempted_job_checkpoints_requeues_and_resumes_exactly(
    slurm_cluster: SlurmCluster, tmp_path: Path, signal_name: str, code: int
) -> None:
    workspace = tmp_path / "run"
    env = {"PYTHON": sys.executable, "WORKSPACE": str(workspace)}
    options = ["--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(SBATCH, *ARGS, options=options, env=env)

    # A few steps into training, between two interval checkpoints, signal the batch shell.
    wait_for(lambda: any(e["event"] == "restore" for e in events(workspace)), 60, "the job to start training")
    time.sleep(0.6)
    slurm_cluster.scancel(job_id, "--batch", f"--signal={signal_name}")

    wait_for(
        lambda: any(e["event"] == "exit" and e["attempt"] == 1 for e in events(workspace)),
        120,
        f"the requeued attempt to finish\n{slurm_cluster.logs()}",
    )
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=60)
    trail = events(workspace)
    first = [e for e in trail if e["attempt"] == 0]
    second = [e for e in trail if e["attempt"] == 1]

    agreed = next(e for e in first if e["event"] == "signal_agreed")
    assert agreed["signal"] == f"SIG{signal_name}"
    saved = [e for e in first if e["event"] == "checkpoint_saved"]
    assert saved[-1]["saved_step"] == agreed["agreed_step"]  # a checkpoint at the signaled step
    requeue = next(e for e in first if e["event"] == "requeue")
    assert requeue["ok"] and requeue["command"] == f"scontrol requeue {job_id}"
    exit_event = next(e for e in first if e["event"] == "exit")
    assert (exit_event["reason"], exit_event["code"]) == ("preempted", code)
    assert [e["event"] for e in first].index("requeue") < [e["event"] for e in first].index("exit")

    start = next(e for e in second if e["event"] == "run_start")
    assert start["slurm"]["job_id"] == job_id and start["slurm"]["restart_count"] == 1
    loaded = next(e for e in second if e["event"] == "checkpoint_loaded")
    assert loaded["from_step"] == agreed["agreed_step"]
    assert next(e for e in second if e["event"] == "exit")["reason"] == "completed"
    assert not [e for e in second if e["event"] == "signal_agreed"]  # requeue's SIGTERM was not a new preemption
    assert job["Restarts"] == "1"

    final = torch.load(workspace / "final.pt")
    expected = uninterrupted(tmp_path)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final)
