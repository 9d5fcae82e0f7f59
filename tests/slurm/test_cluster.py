"""The test cluster itself: a batch job runs to COMPLETED, and ``scontrol requeue`` restarts a job in seconds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = pytest.mark.slurm

# Appends "TIME job=ID restart=N" to $1 (and to its -o file); the first run then sleeps $2 seconds if given.
# SLURM_RESTART_COUNT is unset in a job's first run.
JOB = """\
#!/bin/bash
#SBATCH --job-name=trainfsm-cluster-test
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --time=2
line="$(date +%s.%N) job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT-unset}"
echo "$line" >>"$1"
echo "$line"
if [ -z "${SLURM_RESTART_COUNT-}" ] && [ -n "${2-}" ]; then exec sleep "$2"; fi
"""


def submit(cluster: SlurmCluster, tmp_path: Path, *args: str) -> tuple[str, Path]:
    script = tmp_path / "job.sh"
    script.write_text(JOB)
    runs = tmp_path / "runs.txt"
    options = ["--chdir", str(tmp_path), "--output", str(tmp_path / "slurm-%j.out")]
    return cluster.sbatch(script, str(runs), *args, options=options), runs


def wait_lines(path: Path, n: int, timeout: float) -> list[list[str]]:
    """The first ``n`` lines of ``path``, split into words, once it has them."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [line.split() for line in lines]
        assert time.monotonic() < deadline, f"{path} has {len(lines)} of {n} lines after {timeout:g}s: {lines}"
        time.sleep(0.05)


def test_batch_job_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    submitted = time.time()
    job_id, runs = submit(slurm_cluster, tmp_path)
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=30)

    assert job["ExitCode"] == "0:0"
    [[started, *rest]] = wait_lines(runs, 1, timeout=0)
    assert rest == [f"job={job_id}", "restart=unset"]
    assert (tmp_path / f"slurm-{job_id}.out").read_text().split()[1:] == rest
    print(f"sbatch -> running: {float(started) - submitted:.2f}s")


@pytest.mark.slow
def test_requeue_restarts_the_job_within_seconds(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id, runs = submit(slurm_cluster, tmp_path, "120")
    slurm_cluster.wait_state(job_id, "RUNNING", timeout=30)
    wait_lines(runs, 1, timeout=10)

    requeued = time.time()
    slurm_cluster.run("scontrol", "requeue", job_id)
    [first, second] = wait_lines(runs, 2, timeout=30)
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=30)

    assert first[1:] == [f"job={job_id}", "restart=unset"]
    assert second[1:] == [f"job={job_id}", "restart=1"]
    assert job["Restarts"] == "1"
    out = (tmp_path / f"slurm-{job_id}.out").read_text()  # --open-mode=append: run 1's output is kept
    assert [line.split()[1:] for line in out.splitlines() if " job=" in line] == [first[1:], second[1:]]
    assert "DUE TO JOB REQUEUE" in out  # slurmstepd's note when it ended run 1
    print(f"requeue -> restart: {float(second[0]) - requeued:.2f}s")
