"""examples/slurm/train.sbatch on the real cluster: signal, checkpoint, requeue, restart, exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from trainfsm.tools import audit
from trainfsm.trail.reader import TrailError, read_events

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
ARGS = ("--steps", "60", "--interval", "25", "--step-seconds", "0.05")


def events(workspace: Path) -> list[dict[str, Any]]:
    try:
        return list(read_events(workspace))
    except TrailError:  # no trail yet
        return []


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


@pytest.mark.parametrize(("signal_name", "code"), [("USR1", 138), pytest.param("TERM", 143, marks=pytest.mark.slow)])
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

    # The preemption is timed against the deadline that applied (issues 34, 47): SLURM's end, read at
    # the start and again after the signal, and the audit's seconds from the signal to each stage and the margin.
    [job_end] = [e for e in first if e["event"] == "job_end"]
    assert job_end["after"] == "signal" and job_end["end_time"] == first[0]["slurm"]["end_time"]
    timing = audit.audit([workspace]).attempts[0].as_dict()["preemption"]
    assert (timing["cause"], timing["signal"]) == ("signal", f"SIG{signal_name}")
    # A signal ahead of the time limit: SLURM's kill starts at the limit, its SIGKILL KillWait (10 s) later.
    assert (job_end["applied"], job_end["kill_start"], job_end["kill_wait"]) == ("time_limit", job_end["end_time"], 10)
    assert timing["job_end"] == job_end["kill_at"] == job_end["end_time"] + 10
    assert 0 <= timing["step_finished"] <= timing["agreed"] <= timing["durable"] <= timing["exit"] < 5
    assert timing["margin"] == pytest.approx(job_end["kill_at"] - exit_event["ts"], abs=1e-3)
    assert 3000 < timing["margin"] < 3600 + 10  # a one-hour limit and KillWait, signalled seconds in

    final = torch.load(workspace / "final.pt")
    expected = uninterrupted(tmp_path)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final)


@pytest.mark.slow
def test_a_job_signalled_while_still_in_build_is_requeued_and_completes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``scancel --batch --signal=USR1`` during a slow ``build_model``: the policy is not known yet
    (it comes from the checkpoint hook), the signal is held, BUILD takes ``preempt``, the job is
    requeued exactly as after a preemption during training, and the next attempt completes."""
    script = ROOT / "tests" / "faults" / "early_signal.py"
    workspace, marker = tmp_path / "run", tmp_path / "in_build"
    sbatch = tmp_path / "early.sbatch"
    sbatch.write_text(
        "#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
        'exec "$PYTHON" tests/faults/early_signal.py --workspace "$WORKSPACE" --out "$WORKSPACE/final.pt" '
        '--slow-in build_model --slow 3 --marker "$MARKER"\n'
    )
    env = {"PYTHON": sys.executable, "WORKSPACE": str(workspace), "MARKER": str(marker)}
    options = ["--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(sbatch, options=options, env=env)

    wait_for(marker.exists, 60, f"the job to reach build_model\n{slurm_cluster.logs()}")
    slurm_cluster.scancel(job_id, "--batch", "--signal=USR1")
    wait_for(
        lambda: any(e["event"] == "exit" and e["attempt"] == 1 for e in events(workspace)),
        120,
        f"the requeued attempt to finish\n{slurm_cluster.logs()}",
    )
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=60)
    assert job["Restarts"] == "1"
    trail = events(workspace)
    first = [e for e in trail if e["attempt"] == 0]
    received = next(e for e in first if e["event"] == "signal_received")
    assert (received["signal"], received["at_state"]) == ("SIGUSR1", "BUILD")
    preempt = next(e for e in first if e["event"] == "transition" and e["trigger"] == "preempt")
    assert preempt["source"] == "BUILD"
    requeue = next(e for e in first if e["event"] == "requeue")
    assert requeue["ok"] and requeue["command"] == f"scontrol requeue {job_id}"
    assert (first[-1]["event"], first[-1]["reason"], first[-1]["code"]) == ("exit", "preempted", 138)
    assert not [e for e in first if e["event"] == "checkpoint_saved"]

    second = [e for e in trail if e["attempt"] == 1]
    assert next(e for e in second if e["event"] == "run_start")["slurm"]["restart_count"] == 1
    assert next(e for e in second if e["event"] == "exit")["reason"] == "completed"
    straight = tmp_path / "straight"
    command = [sys.executable, str(script), "--workspace", str(straight), "--out", str(straight / "final.pt")]
    subprocess.run(command, check=True, capture_output=True, timeout=300, cwd=ROOT)
    final, expected = torch.load(workspace / "final.pt"), torch.load(straight / "final.pt")
    assert all(torch.equal(a, b) for a, b in zip(final, expected, strict=True))


@pytest.mark.slow
def test_a_torchrun_job_signalled_as_the_guide_says_is_requeued_and_resumes_exactly(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """examples/slurm/torchrun.sbatch (``exec torchrun`` forwarding SIGUSR1): both ranks agree on a
    step, checkpoint, rank 0 requeues, the second attempt resumes and completes; the audit is clean."""
    from tests.distributed.launch import audit_problems, free_port

    workspace = tmp_path / "run"
    args = ("--steps", "150", "--interval", "1000", "--step-seconds", "0.02", "--timeout", "30")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {"TORCHRUN": torchrun, "WORKSPACE": str(workspace)}
    options = ["--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(ROOT / "examples" / "slurm" / "torchrun.sbatch", *args, options=options, env=env)

    def training(rank: int) -> bool:
        path = workspace / "logs" / f"events.rank{rank}.jsonl"
        return path.exists() and b'"event":"restore"' in path.read_bytes()

    wait_for(lambda: training(0) and training(1), 90, f"both ranks to train\n{slurm_cluster.logs()}")
    time.sleep(0.5)
    slurm_cluster.scancel(job_id, "--batch", "--signal=USR1")
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=240)
    output = next(tmp_path.glob("slurm-*.out")).read_text(errors="replace")
    assert job["Restarts"] == "1", output[-3000:]

    agreed = set()
    for rank in (0, 1):
        trail = list(read_events(workspace, rank))
        first = [e for e in trail if e["attempt"] == 0]
        second = [e for e in trail if e["attempt"] == 1]
        assert next(e for e in first if e["event"] == "signal_received")["signal"] == "SIGUSR1"
        agreed.add(next(e for e in first if e["event"] == "signal_agreed")["agreed_step"])
        assert (first[-1]["event"], first[-1]["reason"], first[-1]["code"]) == ("exit", "preempted", 138)
        assert (second[-1]["event"], second[-1]["reason"]) == ("exit", "completed"), output[-3000:]
        assert next(e for e in second if e["event"] == "run_start")["slurm"]["restart_count"] == 1
        if rank == 0:
            requeue = next(e for e in first if e["event"] == "requeue")
            assert requeue["ok"] and requeue["command"] == f"scontrol requeue {job_id}"
            loaded = next(e for e in second if e["event"] == "checkpoint_loaded")
    (step,) = agreed
    assert loaded["from_step"] == step
    assert audit_problems(workspace) == []

    straight = tmp_path / "straight"
    command = [torchrun, "--rdzv-backend", "static", "--master-port", str(free_port()), "--nproc-per-node", "2"]
    command += ["examples/ddp.py", "--workspace", str(straight), *args]
    subprocess.run(
        command, check=True, capture_output=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    final, expected = torch.load(workspace / "final.pt"), torch.load(straight / "final.pt")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)


def test_a_job_submitted_with_no_requeue_is_refused_and_audit_says_the_run_did_not_end_well(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``sbatch --no-requeue``: the preempted job checkpoints and asks to be requeued, SLURM refuses
    (``requeue ok=false`` with scontrol's error), the job ends FAILED with the trail's exit code, and
    ``trainfsm audit`` exits 1: a consistent trail of a run that nothing will resume."""
    workspace = tmp_path / "run"
    env = {"PYTHON": sys.executable, "WORKSPACE": str(workspace)}
    options = ["--no-requeue", "--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
    job_id = slurm_cluster.sbatch(SBATCH, *ARGS, options=options, env=env)

    wait_for(lambda: any(e["event"] == "restore" for e in events(workspace)), 60, "the job to start training")
    time.sleep(0.6)
    slurm_cluster.scancel(job_id, "--batch", "--signal=USR1")
    job = slurm_cluster.wait_state(job_id, "FAILED", timeout=120)
    trail = events(workspace)
    requeue = next(e for e in trail if e["event"] == "requeue")
    assert not requeue["ok"] and requeue["command"] == f"scontrol requeue {job_id}", requeue
    assert requeue["message"]  # scontrol's own error
    exit_event = trail[-1]
    assert (exit_event["event"], exit_event["reason"], exit_event["code"]) == ("exit", "preempted", 138)
    assert job["ExitCode"] == f"{exit_event['code']}:0" and job["Restarts"] == "0", job
    assert {e["attempt"] for e in trail} == {0}

    trainfsm = Path(sys.executable).with_name("trainfsm")
    argv = [str(trainfsm)] if trainfsm.exists() else [sys.executable, "-m", "trainfsm"]
    audit = subprocess.run([*argv, "audit", "--json", str(workspace)], capture_output=True, text=True, timeout=120)
    assert audit.returncode == 1, audit.stdout + audit.stderr
    report = json.loads(audit.stdout)
    assert report["consistent"] and not report["ended_well"]
    assert [(p["kind"], p["attempt"]) for p in report["run_problems"]] == [("requeue_refused", 0)]
