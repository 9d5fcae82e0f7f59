"""examples/ddp.py under ``srun`` on the real cluster: 2 tasks of one sbatch job, ranks from SLURM's variables."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.distributed.launch import audit_problems, events, free_port, summary

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]

# No RANK/WORLD_SIZE here: init_distributed() reads SLURM_PROCID and SLURM_NTASKS under srun.
JOB = """\
#!/bin/bash
#SBATCH --job-name=trainfsm-srun-ddp
#SBATCH --ntasks=2
#SBATCH --time=5
export MASTER_ADDR=127.0.0.1
export MASTER_PORT={port}
export OMP_NUM_THREADS=1
srun "$PYTHON" examples/ddp.py --workspace "$WORKSPACE" --steps 30 --interval 10 --timeout 60
"""


@pytest.mark.slow  # the fast tier launches ranks with srun in test_srun_torchrun.py
def test_srun_two_tasks_train_with_ddp_and_agreeing_trails(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "ddp.sbatch"
    script.write_text(JOB.format(port=free_port()))
    workspace = tmp_path / "ws"
    env = {"PYTHON": sys.executable, "WORKSPACE": str(workspace)}
    options = ["--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(script, options=options, env=env)
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=120)
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert job["ExitCode"] == "0:0", output[-4000:]

    trails = [events(workspace, rank) for rank in range(2)]
    for rank, trail in enumerate(trails):
        start = next(e for e in trail if e["event"] == "run_start")
        assert (start["rank"], start["world_size"]) == (rank, 2), output[-4000:]
        assert start["slurm"]["job_id"] == job_id and start["slurm"]["procid"] == str(rank)
    summaries = [summary(trail) for trail in trails]
    assert summaries[0]["exit"] == [(30, "completed", 0)]
    assert summaries[0]["checkpoint_steps"] == [10, 20, 30]
    assert summaries[0] == summaries[1]
    assert audit_problems(workspace) == []
    assert (workspace / "checkpoints" / "30" / "manifest.json").is_file()
    assert "rank 0: completed at step 30" in output and "rank 1: completed at step 30" in output


PREEMPTIBLE = """\
#!/bin/bash
#SBATCH --job-name=trainfsm-srun-preempt
#SBATCH --ntasks=2
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --time=5
export MASTER_ADDR=127.0.0.1
export MASTER_PORT={port}
export OMP_NUM_THREADS=1
srun "$PYTHON" examples/ddp.py --workspace "$WORKSPACE" --steps 150 --interval 1000 --step-seconds 0.02 --timeout 60
"""


@pytest.mark.faults
@pytest.mark.slow
def test_srun_tasks_signalled_by_scancel_agree_save_requeue_and_complete(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``scancel --signal=USR1`` (no ``--batch``) reaches every task of the srun step: both ranks
    agree on one step, rank 0 saves and requeues, and the second attempt completes."""
    import time

    script = tmp_path / "preempt.sbatch"
    script.write_text(PREEMPTIBLE.format(port=free_port()))
    workspace = tmp_path / "ws"
    env = {"PYTHON": sys.executable, "WORKSPACE": str(workspace)}
    options = ["--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(script, options=options, env=env)
    deadline = time.monotonic() + 90
    while not all(any(e["event"] == "restore" for e in events(workspace, r)) for r in (0, 1)):
        assert time.monotonic() < deadline, slurm_cluster.logs()
        time.sleep(0.05)
    time.sleep(0.5)
    slurm_cluster.scancel(job_id, "--signal=USR1")
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=240)
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert job["Restarts"] == "1", output[-4000:]
    first = [summary(events(workspace, r), attempt=0) for r in (0, 1)]
    assert first[0] == first[1]
    assert first[0]["exit"][0][1:] == ("preempted", 138)
    second = [summary(events(workspace, r), attempt=1) for r in (0, 1)]
    assert second[0]["exit"] == [(150, "completed", 0)] and second[0] == second[1]
    assert audit_problems(workspace) == []
