"""The stall watchdog on the real cluster (issue 33): a stall with ``stall_action="exit"`` requeues the
job, and the second attempt resumes from the newest checkpoint and completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from trainfsm.trail.reader import read_events
from trainfsm.watchdog import TICKS_PER_SECOND

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("stall_job.py")
STALL_AT = 13  # between the interval checkpoints of steps 10 and 15
ARGS = ("--steps", "30", "--interval", "5", "--stall-timeout", "5")


# The fast tier's stalls: tests/test_watchdog.py (exit 75, reason stalled) and the frozen rank of
# tests/test_watchdog_distributed.py; SLURM's requeue is the preemption's (tests/slurm/test_preemption.py).
@pytest.mark.slow
def test_a_job_stalled_in_forward_is_requeued_by_the_watchdog_and_the_next_attempt_completes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Attempt 0 blocks in ``forward`` at step 13; 5 s later the watchdog writes ``stall``, runs
    ``scontrol requeue``, writes ``exit`` (stalled, 75) and ends the process. SLURM starts the job
    again; attempt 1 loads the checkpoint of step 10, does not block, and completes with the
    parameters of an uninterrupted run. ``trainfsm audit`` finds the trail consistent and the run
    ended well."""
    workspace = tmp_path / "run"
    sbatch = tmp_path / "stall.sbatch"
    sbatch.write_text(
        "#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
        f'exec "$PYTHON" {SCRIPT} --workspace "$WORKSPACE" --out "$WORKSPACE/final.pt" "$@"\n'
    )
    env = {"PYTHON": sys.executable, "WORKSPACE": str(workspace)}
    options = ["--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(sbatch, *ARGS, "--stall-at", str(STALL_AT), options=options, env=env)
    try:
        job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=90)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)  # a job still blocked must not hold the node
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert job["Restarts"] == "1" and job["ExitCode"] == "0:0", output[-3000:]

    trail = list(read_events(workspace))
    assert {e["attempt"] for e in trail} == {0, 1}
    first = [e for e in trail if e["attempt"] == 0]
    second = [e for e in trail if e["attempt"] == 1]

    assert next(e for e in first if e["event"] == "run_start")["slurm"]["restart_count"] == 0
    stall = next(e for e in first if e["event"] == "stall")
    assert (stall["action"], stall["doing"], stall["step"], stall["report"]) == ("exit", "forward", STALL_AT, 1)
    assert stall["budget"] == 5 and stall["seconds"] >= 5 - 1 / TICKS_PER_SECOND  # the watchdog's times are to a tick
    requeue = next(e for e in first if e["event"] == "requeue")
    assert requeue["ok"] and requeue["command"] == f"scontrol requeue {job_id}", requeue
    # The order the watchdog promises: report, requeue, then the attempt's last event, its exit.
    assert (first[-1]["event"], first[-1]["reason"], first[-1]["code"], first[-1]["by"]) == (
        "exit",
        "stalled",
        75,
        "watchdog",
    )
    names = [e["event"] for e in first]
    assert names.index("stall") < names.index("requeue") < len(names) - 1
    saved = [e["saved_step"] for e in first if e["event"] == "checkpoint_saved"]
    assert saved == [5, 10]  # the step-15 checkpoint was never reached

    assert next(e for e in second if e["event"] == "run_start")["slurm"]["restart_count"] == 1
    loaded = next(e for e in second if e["event"] == "checkpoint_loaded")
    assert loaded["from_step"] == saved[-1]
    assert not [e for e in second if e["event"] in ("stall", "requeue")]
    assert (second[-1]["event"], second[-1]["reason"], second[-1]["code"], second[-1]["step"]) == (
        "exit",
        "completed",
        0,
        30,
    )

    trainfsm = Path(sys.executable).with_name("trainfsm")
    argv = [str(trainfsm)] if trainfsm.exists() else [sys.executable, "-m", "trainfsm"]
    audit = subprocess.run([*argv, "audit", "--json", str(workspace)], capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    report = json.loads(audit.stdout)
    assert report["consistent"] and report["ended_well"] and report["run_problems"] == []

    straight = tmp_path / "straight"
    command = [sys.executable, str(SCRIPT), "--workspace", str(straight), "--out", str(straight / "final.pt"), *ARGS]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    subprocess.run(command, check=True, capture_output=True, timeout=120, cwd=ROOT, env=env)
    final, expected = torch.load(workspace / "final.pt"), torch.load(straight / "final.pt")
    assert len(final) == len(expected) and all(torch.equal(a, b) for a, b in zip(final, expected, strict=True))
