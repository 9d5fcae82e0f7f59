"""The job's end on the real cluster (issue 34, items 3 and 4): each preemption's timing and the margin
left before the job's end, as ``trainfsm audit`` reports them; and a job with a time limit and no
``--signal`` that leaves by the trainer's own deadline before every limit, ends COMPLETED (never
TIMEOUT), and trains exactly what an uninterrupted run trains, with synchronous saves and with
asynchronous ones whose writes take longer than the exit allows (issue 46, finding 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from trainfsm.trail.reader import TrailError, read_events

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "slurm" / "train.py"
SLOW_SAVES = Path(__file__).with_name("slow_save_job.py")
# The example's own sbatch asks for --signal=B:USR1@120: these jobs must get no signal from SLURM.
JOB = (
    "#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
    'exec "$PYTHON" "$SCRIPT" --workspace "$WORKSPACE" "$@"\n'
)


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


@pytest.fixture
def submit(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[Callable[..., tuple[str, Path]]]:
    """``submit(TIME_LIMIT, *ARGS, script=TRAIN)``: the example's training (or ``script``) as a batch
    job with that ``--time``; returns the job id and its workspace. A job still there when the test
    ends is cancelled."""
    jobs: list[str] = []

    def start(time_limit: str, *args: str, script: Path = TRAIN) -> tuple[str, Path]:
        workspace, sbatch = tmp_path / "run", tmp_path / "job.sbatch"
        sbatch.write_text(JOB)
        env = {"PYTHON": sys.executable, "WORKSPACE": str(workspace), "SCRIPT": str(script)}
        options = [f"--time={time_limit}", "--chdir", str(ROOT), "--output", str(tmp_path / "slurm-%j.out")]
        jobs.append(slurm_cluster.sbatch(sbatch, *args, options=options, env=env))
        return jobs[-1], workspace

    yield start
    for job_id in jobs:
        slurm_cluster.run("scancel", job_id, check=False)


def end_time(cluster: SlurmCluster, job_id: str) -> float:
    """The job's EndTime as SLURM says it now, in epoch seconds."""
    shown = cluster.run("scontrol", "show", "job", "-o", job_id, env={"SLURM_TIME_FORMAT": "%s"}).stdout
    found = re.search(r"\bEndTime=(\d+)", shown)
    assert found, shown
    return float(found.group(1))


def audit(workspace: Path, *options: str) -> subprocess.CompletedProcess[str]:
    trainfsm = Path(sys.executable).with_name("trainfsm")
    argv = [str(trainfsm)] if trainfsm.exists() else [sys.executable, "-m", "trainfsm"]
    return subprocess.run([*argv, "audit", *options, str(workspace)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def uninterrupted(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start the same training outside SLURM (it sleeps most of its time: it may overlap the job);
    a run still going when the test ends is killed."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, script: Path = TRAIN) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        command = [sys.executable, str(script), "--workspace", str(tmp_path / "straight"), *args]
        started.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def same_parameters(workspace: Path, straight: subprocess.Popen[bytes], tmp_path: Path) -> bool:
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err.decode()[-3000:]
    final, expected = torch.load(workspace / "final.pt"), torch.load(tmp_path / "straight" / "final.pt")
    return final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)


# The fast tier times one preemption (tests/slurm/test_preemption.py); two in a row run in `make test-all`.
@pytest.mark.slow
def test_a_job_preempted_twice_has_both_preemptions_timed_with_the_margin_before_the_jobs_end(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    uninterrupted: Callable[..., subprocess.Popen[bytes]],
    submit: Callable[..., tuple[str, Path]],
) -> None:
    """``scancel --batch --signal=USR1`` in two attempts of a job with a 5-minute limit. Each attempt's
    rank 0 reads the job's end from SLURM at ``run_start`` and again after the signal (``job_end``);
    ``trainfsm audit`` prints, for both preemptions, the step finished, the ranks agreed, the
    checkpoint durable and the exit in seconds after the signal, and the margin left before the
    job's end, which is the EndTime SLURM showed when the signal was sent."""
    args = ("--steps", "120", "--interval", "1000", "--step-seconds", "0.05")
    straight = uninterrupted(*args)
    job_id, workspace = submit("5", *args)
    ends = []
    for attempt in (0, 1):
        wait_for(
            lambda attempt=attempt: any(e["event"] == "restore" and e["attempt"] == attempt for e in events(workspace)),
            90,
            f"attempt {attempt} to train\n{slurm_cluster.logs()}",
        )
        time.sleep(0.6)
        ends.append(end_time(slurm_cluster, job_id))
        slurm_cluster.scancel(job_id, "--batch", "--signal=USR1")
        wait_for(
            lambda attempt=attempt: any(e["event"] == "exit" and e["attempt"] == attempt for e in events(workspace)),
            60,
            f"attempt {attempt} to exit\n{slurm_cluster.logs()}",
        )
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=120)
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert job["Restarts"] == "2", output[-3000:]

    trail = events(workspace)
    for attempt, end in enumerate(ends):
        mine = [e for e in trail if e["attempt"] == attempt]
        assert mine[0]["slurm"]["end_time"] == end  # SLURM's end at the start: nothing moved it since
        [job_end] = [e for e in mine if e["event"] == "job_end"]
        assert (job_end["end_time"], job_end["after"]) == (end, "signal")
        assert (mine[-1]["event"], mine[-1]["reason"], mine[-1]["code"]) == ("exit", "preempted", 138)

    text = audit(workspace)
    assert text.returncode == 0, text.stdout + text.stderr
    lines = [line.strip() for line in text.stdout.splitlines() if line.strip().startswith("preemption:")]
    print("\n".join(lines))
    assert len(lines) == 2, text.stdout
    pattern = (
        r"preemption: SIGUSR1 at step \d+; step finished \+\d+\.\d\d s, ranks agreed \+\d+\.\d\d s, "
        r"checkpoint durable \+\d+\.\d\d s, exit \+\d+\.\d\d s; "
        r"deadline \+\d+\.\d s \(the time limit \+ KillWait 10 s\), margin \d+\.\d s at exit"
    )
    assert all(re.fullmatch(pattern, line) for line in lines), lines

    report = json.loads(audit(workspace, "--json").stdout)
    assert report["consistent"] and report["ended_well"], report["problems"] + report["run_problems"]
    timings = [a["preemption"] for a in report["attempts"]]
    assert timings[2] is None  # the last attempt completed
    for attempt, (timing, end) in enumerate(zip(timings[:2], ends, strict=True)):
        exit_at = next(e["ts"] for e in trail if e["attempt"] == attempt and e["event"] == "exit")
        # The deadline that applied: the time limit, and SIGKILL KillWait (10 s) after it.
        assert (timing["cause"], timing["signal"], timing["job_end"], timing["job_end_read"], timing["applied"]) == (
            "signal",
            "SIGUSR1",
            end + 10,
            "signal",
            "time_limit",
        )
        assert 0 <= timing["step_finished"] <= timing["agreed"] <= timing["durable"] <= timing["exit"] < 5
        assert timing["margin"] == pytest.approx(end + 10 - exit_at, abs=1e-3)
        assert 200 < timing["margin"] < timing["warning"] <= 310  # a 5-minute limit, signalled seconds in
    assert not [n for n in report["notes"] if "job's end" in n["message"]]  # margins are wide: no advice
    assert same_parameters(workspace, straight, tmp_path)


@pytest.mark.slow
def test_a_job_with_a_time_limit_and_no_signal_ends_each_attempt_by_its_own_deadline_and_completes(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    uninterrupted: Callable[..., subprocess.Popen[bytes]],
    submit: Callable[..., tuple[str, Path]],
) -> None:
    """``--time=1``, no ``--signal``, about 100 s of work (1,000 steps of 0.1 s: fewer steps, so the
    machine's load adds less to it), where an attempt trains about 40 s of its minute: at least three
    attempts. Every attempt but the last ends by
    the trainer's own deadline before SLURM's limit (``deadline``, ``signal_agreed`` reason deadline,
    a save, ``scontrol requeue``, exit 138); the last one completes before its limit. The job ends
    COMPLETED, never TIMEOUT, with the parameters of an uninterrupted run; the audit times each
    preemption and finds the trail consistent and the run ended well."""
    args = ("--steps", "1000", "--interval", "1000", "--step-seconds", "0.1")
    straight = uninterrupted(*args)
    job_id, workspace = submit("1", *args)
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=600)  # fails at once on TIMEOUT
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    trail = events(workspace)
    attempts = sorted({e["attempt"] for e in trail})
    assert len(attempts) >= 3 and job["Restarts"] == str(len(attempts) - 1), output[-3000:]
    assert job["ExitCode"] == "0:0"

    for attempt in attempts:
        mine = [e for e in trail if e["attempt"] == attempt]
        end = mine[0]["slurm"]["end_time"]
        assert end is not None and mine[-1]["event"] == "exit" and mine[-1]["ts"] < end, mine[-1]
        if attempt == attempts[-1]:
            assert (mine[-1]["reason"], mine[-1]["code"]) == ("completed", 0)
            assert not [e for e in mine if e["event"] in ("deadline", "signal_agreed", "requeue")]
            continue
        [made] = [e for e in mine if e["event"] == "deadline"]
        [agreed] = [e for e in mine if e["event"] == "signal_agreed"]
        assert (agreed["reason"], agreed["signal"], agreed["agreed_step"]) == ("deadline", "SIGUSR1", made["step"])
        # The trainer fires once left < needed; the event gives both to the millisecond, which can
        # make them equal (CI: 15.133 and 15.133).
        assert made["end_time"] == end and made["left"] <= made["needed"]
        # SLURM sent nothing before the deadline; its SIGTERM after the trainer's requeue is in the trail.
        received = [(e["signal"], e["at_state"]) for e in mine if e["event"] == "signal_received"]
        assert received == [("SIGTERM", "EXIT")]
        assert [e["saved_step"] for e in mine if e["event"] == "checkpoint_saved"][-1] == made["step"]
        requeue = next(e for e in mine if e["event"] == "requeue")
        assert requeue["ok"] and requeue["command"] == f"scontrol requeue {job_id}"
        assert (mine[-1]["reason"], mine[-1]["code"]) == ("preempted", 138)
        print(
            f"attempt {attempt}: deadline at step {made['step']}, {made['left']:.1f} s left, needed "
            f"{made['needed']:.1f} s; exit {end - mine[-1]['ts']:.1f} s before the limit"
        )

    report = json.loads(audit(workspace, "--json").stdout)
    assert report["consistent"] and report["ended_well"], report["problems"] + report["run_problems"]
    for attempt in report["attempts"][:-1]:
        timing = attempt["preemption"]
        assert timing["cause"] == "deadline" and timing["margin"] > 0 and not timing["save_after_end"]
    assert report["attempts"][-1]["preemption"] is None
    assert same_parameters(workspace, straight, tmp_path)


@pytest.mark.slow
def test_with_asynchronous_saves_slower_than_the_exit_each_attempt_is_saved_and_requeued_before_its_end(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    uninterrupted: Callable[..., subprocess.Popen[bytes]],
    submit: Callable[..., tuple[str, Path]],
) -> None:
    """The job above with ``async_save`` on a file system where each save's write takes 8 s, more than
    the deadline's 5 s for the exit and its 1 s margin together (``tests/slurm/slow_save_job.py``),
    and about 45 s of steps in a one-minute limit. The CHECKPOINT state only stages a save; the
    deadline counts the write as the background writer timed it at the interval's saves
    (``write_seconds``), so every attempt but the last has its checkpoint durable, the job requeued
    and the process gone before SLURM's limit. The job ends COMPLETED, never TIMEOUT, with the
    parameters of an uninterrupted run."""
    args = ("--async-save", "--steps", "900", "--interval", "300", "--write-seconds", "8", "--job-end-margin", "1")
    straight = uninterrupted(*args, script=SLOW_SAVES)
    job_id, workspace = submit("1", *args, script=SLOW_SAVES)
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=400)  # fails at once on TIMEOUT
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    trail = events(workspace)
    attempts = sorted({e["attempt"] for e in trail})
    assert len(attempts) >= 2 and job["Restarts"] == str(len(attempts) - 1), output[-3000:]

    for attempt in attempts:
        mine = [e for e in trail if e["attempt"] == attempt]
        end = mine[0]["slurm"]["end_time"]
        saved = [e for e in mine if e["event"] == "checkpoint_saved"]
        assert end is not None and mine[-1]["event"] == "exit" and mine[-1]["ts"] < end, mine[-1]
        if attempt == attempts[-1]:
            assert (mine[-1]["reason"], mine[-1]["code"]) == ("completed", 0)
            continue
        [made] = [e for e in mine if e["event"] == "deadline"]
        assert made["write_seconds"] >= 8 and made["end_time"] == end
        assert saved[-1]["saved_step"] == made["step"] and saved[-1]["seconds"] >= 8
        requeue = next(e for e in mine if e["event"] == "requeue")
        assert requeue["ok"] and saved[-1]["ts"] < requeue["ts"] < mine[-1]["ts"] < end
        assert (mine[-1]["reason"], mine[-1]["code"]) == ("preempted", 143)
        print(
            f"attempt {attempt}: deadline at step {made['step']}, {made['left']:.1f} s left, needed "
            f"{made['needed']:.1f} s (write {made['write_seconds']:.1f} s); checkpoint durable "
            f"{end - saved[-1]['ts']:.1f} s and exit {end - mine[-1]['ts']:.1f} s before the limit"
        )
    report = json.loads(audit(workspace, "--json").stdout)
    assert report["consistent"] and report["ended_well"], report["problems"] + report["run_problems"]
    assert same_parameters(workspace, straight, tmp_path)


@pytest.mark.slow
def test_a_time_limit_shortened_during_the_job_moves_the_deadline_and_the_attempt_leaves_before_the_new_end(
    slurm_cluster: SlurmCluster, submit: Callable[..., tuple[str, Path]]
) -> None:
    """``--time=3`` and about 70 s of steps; once the first attempt trains, ``scontrol update
    TimeLimit=1`` brings the job's end to a minute after its start. Rank 0 reads the end again (every
    2 s here; a minute by default) and leaves by its deadline before the new end: saved, requeued,
    exit 143. The next attempt, with the one-minute limit, completes; the job ends COMPLETED."""
    args = ("--steps", "1400", "--interval", "1000", "--write-seconds", "0", "--reread-seconds", "2")
    job_id, workspace = submit("3", *args, "--job-end-margin", "1", script=SLOW_SAVES)
    wait_for(lambda: any(e["event"] == "restore" for e in events(workspace)), 90, f"training\n{slurm_cluster.logs()}")
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=1")
    moved = end_time(slurm_cluster, job_id)
    job = slurm_cluster.wait_state(job_id, "COMPLETED", timeout=300)  # fails at once on TIMEOUT
    assert job["Restarts"] == "1"
    first = [e for e in events(workspace) if e["attempt"] == 0]
    assert first[0]["slurm"]["end_time"] == moved + 120  # three minutes at the start
    [made] = [e for e in first if e["event"] == "deadline"]
    assert made["end_time"] == moved and made["step"] > 0
    requeue = next(e for e in first if e["event"] == "requeue")
    assert requeue["ok"] and (first[-1]["reason"], first[-1]["code"]) == ("preempted", 143)
    assert first[-1]["ts"] < moved
    print(f"end moved 120 s earlier; deadline at step {made['step']}, exit {moved - first[-1]['ts']:.1f} s before it")
