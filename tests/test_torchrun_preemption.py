"""Preemption under torch's launcher: real torchrun, real gloo ranks, real signals.

``examples/ddp.py`` with its default ``CheckpointingHook()`` (SIGTERM and SIGUSR1). torchrun
forwards only the signals in ``--signals-to-handle`` to its workers; any other one kills it, and
the kernel then sends each worker SIGTERM (``trainfsm.preemption.policy.on_launcher_death``), so no worker
trains on as an orphan. Elastic restarts: ``tests/faults/elastic_restart.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import ROOT, alive, events, free_port
from tests.faults import elastic_restart

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="torchrun and prctl: Linux"),
    pytest.mark.distributed,
    pytest.mark.faults,
]

EXAMPLE = ROOT / "examples" / "ddp.py"
FORWARD_USR1 = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
ARGS = ("--steps", "150", "--interval", "1000", "--step-seconds", "0.02", "--timeout", "30")


def torchrun(workspace: Path, log: Path, *launcher_args: str) -> subprocess.Popen[bytes]:
    launcher = Path(sys.executable).with_name("torchrun")
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--rdzv-backend", "static", "--master-port", str(free_port()), "--nproc-per-node", "2"]
    command += [*launcher_args, str(EXAMPLE), "--workspace", str(workspace), *ARGS]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    with open(log, "ab") as out:  # a file: nobody reads a pipe while the test waits
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def started_training(workspace: Path, process: subprocess.Popen[bytes], log: Path) -> list[int]:
    """Wait until both ranks are training; their pids."""
    deadline = time.monotonic() + 120
    while not all(any(e["event"] == "restore" for e in events(workspace, r)) for r in (0, 1)):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    time.sleep(0.5)  # some steps into training
    pids = elastic_restart.workers(process.pid)
    assert len(pids) == 2, pids
    return pids


def last_attempt(workspace: Path, rank: int) -> list[dict[str, Any]]:
    trail = events(workspace, rank)
    return [e for e in trail if e["attempt"] == trail[-1]["attempt"]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    directory = tmp_path_factory.mktemp("straight")
    process = torchrun(directory / "ws", directory / "log")
    assert process.wait(timeout=240) == 0, (directory / "log").read_text()[-3000:]
    return torch.load(directory / "ws" / "final.pt")  # type: ignore[no-any-return]


def test_sigusr1_to_torchrun_that_does_not_forward_it_leaves_no_rank_training(tmp_path: Path) -> None:
    workspace, log = tmp_path / "ws", tmp_path / "log"
    process = torchrun(workspace, log)
    pids: list[int] = []
    try:
        pids = started_training(workspace, process, log)
        process.send_signal(signal.SIGUSR1)
        assert process.wait(timeout=60) == -signal.SIGUSR1  # torchrun dies of it: it does not handle SIGUSR1
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"orphaned workers still running: {pids}"
            time.sleep(0.05)
    finally:
        elastic_restart.reap(process, pids)
    for rank in (0, 1):
        mine = last_attempt(workspace, rank)
        received = [e for e in mine if e["event"] == "signal_received"]
        assert received and received[0]["signal"] == "SIGTERM"  # the launcher's death, as SIGTERM
        agreed = next(e for e in mine if e["event"] == "signal_agreed")
        assert (mine[-1]["event"], mine[-1]["reason"], mine[-1]["code"]) == ("exit", "preempted", 143)
        if rank == 0:
            saved = [e["saved_step"] for e in mine if e["event"] == "checkpoint_saved"]
            assert saved == [agreed["agreed_step"]]


@pytest.mark.slow  # the fast tier forwards a signal through torchrun in tests/test_two_nodes.py
def test_sigusr1_forwarded_by_torchrun_checkpoints_every_rank_and_the_relaunch_resumes_exactly(
    tmp_path: Path, straight: dict[str, torch.Tensor]
) -> None:
    workspace, log = tmp_path / "ws", tmp_path / "log"
    process = torchrun(workspace, log, "--signals-to-handle", FORWARD_USR1)
    pids: list[int] = []
    try:
        pids = started_training(workspace, process, log)
        process.send_signal(signal.SIGUSR1)
        code = process.wait(timeout=90)
    finally:
        elastic_restart.reap(process, pids)
    assert code != 0  # torchrun re-raises the signal as a SignalException: the job step "failed"
    agreed = set()
    for rank in (0, 1):
        mine = last_attempt(workspace, rank)
        assert [e["signal"] for e in mine if e["event"] == "signal_received"][:1] == ["SIGUSR1"]
        agreed.add(next(e for e in mine if e["event"] == "signal_agreed")["agreed_step"])
        assert (mine[-1]["event"], mine[-1]["reason"], mine[-1]["code"]) == ("exit", "preempted", 138)
    (step,) = agreed
    assert (workspace / "checkpoints" / str(step) / "manifest.json").is_file()

    relaunch = torchrun(workspace, log, "--signals-to-handle", FORWARD_USR1)
    assert relaunch.wait(timeout=240) == 0, log.read_text()[-3000:]
    loaded = next(e for e in last_attempt(workspace, 0) if e["event"] == "checkpoint_loaded")
    assert loaded["from_step"] == step
    final = torch.load(workspace / "final.pt")
    assert final.keys() == straight.keys() and all(torch.equal(final[k], straight[k]) for k in final)


# SIGKILL under torchrun's restarts: the fast tier's trial is test_two_nodes.py's (a worker killed, both
# nodes restarted by their agents); its 5 trials on one node run in `make test-all`.
@pytest.mark.slow
@pytest.mark.parametrize("trials", [5], ids=["5 trials"])
def test_sigkill_of_one_rank_under_max_restarts_ends_in_a_restarted_group_that_completes_exactly(
    capsys: pytest.CaptureFixture[str], trials: int
) -> None:
    passed, failed = elastic_restart.run_trials(trials=trials, seed=20261124, fault="kill")
    assert (passed, failed) == (trials, 0), capsys.readouterr().out


# An exception on one rank: the fast tier's is tests/test_distributed_faults.py's, and torchrun's restart
# is test_two_nodes.py's; these 5 trials under torchrun run in `make test-all`.
@pytest.mark.slow
@pytest.mark.parametrize("trials", [5], ids=["5 trials"])
def test_an_exception_on_one_rank_under_max_restarts_ends_in_a_restarted_group_that_completes_exactly(
    capsys: pytest.CaptureFixture[str], trials: int
) -> None:
    passed, failed = elastic_restart.run_trials(trials=trials, seed=20261125, fault="raise")
    assert (passed, failed) == (trials, 0), capsys.readouterr().out


@pytest.mark.slow
def test_a_rank_failing_at_every_attempt_stops_after_max_restarts_with_the_failure_named(tmp_path: Path) -> None:
    from trainfsm.tools import trace

    workspace, log = tmp_path / "ws", tmp_path / "log"
    process = elastic_restart.torchrun(workspace, False, 3, log, "trainfsm", "--every-attempt")
    try:
        code = process.wait(timeout=240)
    finally:
        elastic_restart.reap(process)
    output = log.read_text(errors="replace")
    assert code == 1, output[-3000:]
    assert "injected failure at step 3" in output  # torchrun's summary shows the failed rank's error
    for rank in (0, 1):
        starts = [e for e in events(workspace, rank) if e["event"] == "run_start"]
        assert [e["torchelastic"]["restart_count"] for e in starts] == [0, 1, 2]  # --max-restarts 2
    failures = [e for e in events(workspace, 1) if e["event"] == "exception"]
    assert [(e["attempt"], e["message"]) for e in failures] == [(a, "injected failure at step 3") for a in range(3)]
    text = trace.render(trace.trace([workspace]))
    assert text.count("cause: rank 1 in ACCUMULATE running step 3: RuntimeError: injected failure at step 3") == 3, text
