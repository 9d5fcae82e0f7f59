"""examples/slurm/multinode.sbatch on the real cluster: ``srun`` starts two torchrun agents (the multi-node
form, c10d rendezvous, the first task hosting the store), ``scancel --signal=USR1`` preempts them, and the
requeued job resumes exactly.

The cluster has one node, so the two agents (one per node in real use) are two tasks on that node:
``--nodes=1 --ntasks-per-node=2`` on the command line overrides the script's ``--nodes=2
--ntasks-per-node=1``. The network between nodes, and nodes that start at different times, are not
exercised here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.distributed.launch import audit_problems, events, free_port, run_problems, summary

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "multinode.sbatch"
ARGS = ("--steps", "150", "--interval", "1000", "--step-seconds", "0.02", "--timeout", "30")


def uninterrupted(torchrun: str, workspace: Path) -> subprocess.Popen[bytes]:
    """The same training with no signal, started now: plain torchrun, two workers on one agent."""
    workspace.mkdir()
    command = [torchrun, "--rdzv-backend", "static", "--master-port", str(free_port()), "--nproc-per-node", "2"]
    command += ["examples/ddp.py", "--workspace", str(workspace), *ARGS]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    with open(workspace / "output.txt", "wb") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env={**env, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed as a whole if the test fails
        )


@pytest.mark.faults
@pytest.mark.slow
def test_srun_torchrun_agents_signalled_by_scancel_agree_save_requeue_and_resume_exactly(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``scancel --signal=USR1`` reaches both agents (the step's tasks); each forwards SIGUSR1 to its
    worker; the ranks agree on one step, rank 0 saves it once and requeues; the requeued job's agents
    meet again under the same ``--rdzv-id`` (the job id), resume from that step and complete with the
    parameters of an uninterrupted run."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    workspace, straight = tmp_path / "run", tmp_path / "straight"
    env = {"TORCHRUN": torchrun, "WORKSPACE": str(workspace), "RDZV_PORT": str(free_port())}
    options = ["--nodes=1", "--ntasks-per-node=2", "--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(SBATCH, *ARGS, options=options, env=env)
    reference = None
    try:
        deadline = time.monotonic() + 90
        while not all(any(e["event"] == "restore" for e in events(workspace, r)) for r in (0, 1)):
            assert time.monotonic() < deadline, f"both ranks did not start training\n{slurm_cluster.logs()}"
            time.sleep(0.05)
        time.sleep(0.5)
        slurm_cluster.scancel(job_id, "--signal=USR1")  # every task of the job's steps: both agents
        reference = uninterrupted(torchrun, straight)  # while the requeued job waits to start again
        job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=120)
        output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
        assert job["Restarts"] == "1", output[-4000:]
        assert reference.wait(timeout=120) == 0, (straight / "output.txt").read_text(errors="replace")[-3000:]
    finally:
        if reference is not None and reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait()

    # Both agents received the signal and forwarded it (each worker's own trail has it).
    assert len(re.findall(r"Received (?:10|SIGUSR1|Signals.SIGUSR1) death signal", output)) == 2, output[-4000:]
    trails = [events(workspace, rank) for rank in (0, 1)]
    agreed = set()
    for trail in trails:
        first = [e for e in trail if e["attempt"] == 0]
        second = [e for e in trail if e["attempt"] == 1]
        starts = [next(e for e in attempt if e["event"] == "run_start") for attempt in (first, second)]
        assert [s["slurm"]["restart_count"] for s in starts] == [0, 1]
        assert all(s["torchelastic"]["run_id"] == job_id and s["world_size"] == 2 for s in starts)
        assert next(e for e in first if e["event"] == "signal_received")["signal"] == "SIGUSR1"
        agreed.add(next(e for e in first if e["event"] == "signal_agreed")["agreed_step"])
        assert (first[-1]["event"], first[-1]["reason"], first[-1]["code"]) == ("exit", "preempted", 138)
        assert (second[-1]["event"], second[-1]["reason"], second[-1]["step"]) == ("exit", "completed", 150)
        assert not [e for e in second if e["event"] == "signal_agreed"]  # the requeue's SIGTERM is not a preemption
    # Which agent's worker got rank 0 is c10d's choice; each task started one.
    assert {next(e for e in t if e["event"] == "run_start")["slurm"]["procid"] for t in trails} == {"0", "1"}

    (step,) = agreed
    assert 0 < step < 150
    first0, second0 = ([e for e in trails[0] if e["attempt"] == a] for a in (0, 1))
    assert [e["saved_step"] for e in first0 if e["event"] == "checkpoint_saved"] == [step]  # saved once
    requeue = next(e for e in first0 if e["event"] == "requeue")
    assert requeue["command"] == f"scontrol requeue {job_id}"
    # The requeue makes SLURM SIGTERM the agents, which pass it on to their worker's whole process
    # group; scontrol runs in a session of its own, so a requeue that worked is reported as one.
    assert requeue["ok"], requeue
    assert not [e for e in trails[1] if e["event"] in ("checkpoint_saved", "requeue")]  # rank 0's work only
    assert next(e for e in second0 if e["event"] == "checkpoint_loaded")["from_step"] == step
    for attempt in (0, 1):
        ours = [summary(trail, attempt=attempt) for trail in trails]
        assert ours[0] == ours[1]
    assert audit_problems(workspace) == [] and run_problems(workspace) == []

    final, expected = torch.load(workspace / "final.pt"), torch.load(straight / "final.pt")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)


@pytest.mark.slow  # 18 s; the fast tier's SLURM trials are the preemptions (test_preemption, test_preempted_by_job)
def test_the_example_with_launcher_srun_runs_one_rank_per_task(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The same file's other form, ``LAUNCHER=srun``: no torchrun, each srun task is a rank (its
    preemption under srun is test_srun_ddp's business)."""
    workspace = tmp_path / "run"
    env = {"PYTHON": sys.executable, "LAUNCHER": "srun", "WORKSPACE": str(workspace), "RDZV_PORT": str(free_port())}
    options = ["--nodes=1", "--ntasks-per-node=2", "--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(
        SBATCH, "--steps", "20", "--interval", "10", "--timeout", "30", options=options, env=env
    )
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=90)
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert job["ExitCode"] == "0:0" and job["Restarts"] == "0", output[-4000:]
    for rank in (0, 1):
        trail = events(workspace, rank)
        start = next(e for e in trail if e["event"] == "run_start")
        assert (start["rank"], start["world_size"], start["slurm"]["procid"]) == (rank, 2, str(rank))
        assert start["torchelastic"] is None  # no torchrun
        assert summary(trail)["exit"] == [(20, "completed", 0)]
    assert audit_problems(workspace) == [] and run_problems(workspace) == []
