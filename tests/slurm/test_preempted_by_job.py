"""A real preemption by a higher-priority job (issue 47), in each way the project's cluster preempts.

A job of ``tests/slurm/preempted_job.py`` runs in a preemptible partition (``low``: REQUEUE with a
30 s GraceTime; ``low-cancel``: CANCEL, 30 s; ``low-nograce``: REQUEUE, no grace time) on 5 of the
node's 10 CPUs; a job of ``high`` asking for 6 (``sleep 1``) fits only once SLURM has taken the
node from it. In every trial the preempted attempt saves the step the trainer agreed on, the job is
requeued (by the trainer, or by SLURM itself), the next attempt loads that checkpoint, the job ends
COMPLETED with the parameters of an uninterrupted run (``torch.equal``), ``trainfsm audit`` exits 0
and its preemption line names the deadline that applied and a positive margin. Every signal the
process received is in the trail, SLURM's SIGTERM after the trainer's own requeue included.

What SLURM 22.05 does (measured on this cluster, ``tests/slurm/cluster.sh``): at the preemption it
sets the job's ``PreemptTime`` and moves its ``EndTime`` to ``PreemptTime + GraceTime``; it signals
an ``exec python`` batch job only with ``preempt_send_user_signal`` (its ``--signal``, at once), or
once the grace time is over (SIGTERM on slurmctld's 30 s tick, SIGKILL ``KillWait`` = 10 s later).
Without the user signal the trainer must see the ``PreemptTime`` itself (rank 0 reads the job every
``PREEMPTED_REREAD_FLOOR`` s here) and leave within the grace time; the last trial makes that tight
with 30 s steps. With GraceTime 0 the SIGTERM comes at once and SLURM requeues the job itself: that
is no failed requeue.

The trials share the node's preemptible CPUs: the module runs on one worker, one trial at a time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from trainfsm.preemption.slurm import PREEMPTED_REREAD_FLOOR
from trainfsm.tools import audit
from trainfsm.trail.reader import TrailError, read_events

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("preempted_job.py")
CLUSTER_SH = Path(__file__).with_name("cluster.sh")
#: ``--signal`` only where a trial asks for it: SLURM sends nothing else before the time limit.
JOB = (
    "#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
    'exec "$PYTHON" "$SCRIPT" --workspace "$WORKSPACE" "$@"\n'
)
GRACE_TIME = 30.0  # the partitions low and low-cancel (cluster.sh, TRAINFSM_SLURM_GRACE)
KILL_WAIT = 10.0  # cluster.sh's KillWait
#: The preemptible job's CPUs and the high job's: together more than the node's 10.
LOW_CPUS, HIGH_CPUS = 5, 6
#: Seconds from the high job's submission to the preemption: SLURM preempts when it schedules the
#: high job, at the submission or at its next pass (cluster.sh: sched_interval=2, bf_interval=1).
SCHEDULED_WITHIN = 2.5


@dataclass
class Trial:
    """One preemption trial: the preemptible job, the job that preempts it, and the same training
    outside SLURM (uninterrupted), with the trail and the job's output at hand."""

    cluster: SlurmCluster
    tmp_path: Path
    workspace: Path
    jobs: list[str] = field(default_factory=list)
    straight: subprocess.Popen[bytes] | None = None
    preempted_at: float | None = None  # when the high job was submitted (epoch seconds)

    def submit(self, partition: str, *args: str, options: tuple[str, ...] = ("--time=10",)) -> str:
        """The job in ``partition`` with ``args`` (``preempted_job.py``'s) and ``options`` (sbatch's:
        a 10-minute limit unless given others); and, outside SLURM, the same training with no sleep
        in its steps, which does not change what it computes."""
        sbatch = self.tmp_path / "job.sbatch"
        sbatch.write_text(JOB)
        env = {"PYTHON": sys.executable, "WORKSPACE": str(self.workspace), "SCRIPT": str(SCRIPT)}
        options = (
            "-p",
            partition,
            "-c",
            str(LOW_CPUS),
            "--chdir",
            str(ROOT),
            "--output",
            str(self.tmp_path / "slurm-%j.out"),
            *options,
        )
        self.jobs.append(self.cluster.sbatch(sbatch, *args, options=options, env=env))
        straight_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        command = [sys.executable, str(SCRIPT), "--workspace", str(self.tmp_path / "straight"), *args]
        command += ["--step-seconds", "0"]
        self.straight = subprocess.Popen(
            command, cwd=ROOT, env=straight_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        return self.jobs[-1]

    def preempt(self) -> str:
        """Submit the higher-priority job that needs the preemptible job's CPUs."""
        self.preempted_at = time.time()
        options = ["-p", "high", "-c", str(HIGH_CPUS), "--output", str(self.tmp_path / "high-%j.out")]
        options += ["--chdir", str(self.tmp_path), "--wrap", "sleep 1"]
        out = self.cluster.run("sbatch", "--parsable", *options).stdout.strip()
        self.jobs.append(out.split(";")[0])
        return self.jobs[-1]

    def events(self) -> list[dict[str, Any]]:
        try:
            return list(read_events(self.workspace))
        except TrailError:  # no trail yet
            return []

    def attempt(self, number: int) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["attempt"] == number]

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
            time.sleep(0.05)

    def training(self, attempt: int = 0) -> None:
        """Wait until the attempt trains (``restore``): its exit policy and signal handlers are set."""
        self.wait_for(
            lambda: any(e["event"] == "restore" for e in self.attempt(attempt)), 90, f"attempt {attempt} to train"
        )

    def completed(self, job_id: str, timeout: float = 180) -> dict[str, str]:
        """The job once COMPLETED (fails at once on another final state, e.g. PREEMPTED)."""
        return self.cluster.wait_state(job_id, "COMPLETED", timeout=timeout)

    def same_as_uninterrupted(self) -> bool:
        assert self.straight is not None
        _, err = self.straight.communicate(timeout=300)
        assert self.straight.returncode == 0, err.decode()[-3000:]
        final = torch.load(self.workspace / "final.pt")
        expected = torch.load(self.tmp_path / "straight" / "final.pt")
        return final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp_path.glob("slurm-*.out")))


@pytest.fixture
def trial(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[Trial]:
    """A trial; at its end, the cluster's logs and the job's output (pytest shows them when the test
    failed), then every job it submitted is cancelled, so a failed trial leaves no job holding CPUs."""
    started = time.monotonic()
    found = Trial(slurm_cluster, tmp_path, tmp_path / "run")
    yield found
    print(f"trial: {time.monotonic() - started:.1f} s wall\n{slurm_cluster.logs()}\n---- job output\n")
    print(found.output()[-6000:])
    for job_id in found.jobs:
        slurm_cluster.run("scancel", job_id, check=False)
    if found.straight is not None and found.straight.poll() is None:
        found.straight.kill()
        found.straight.wait()


@pytest.fixture
def user_signal(slurm_cluster: SlurmCluster) -> Iterator[None]:
    """``preempt_send_user_signal`` on for this test only: off again afterwards, whatever happened."""

    def user_signal(value: str) -> None:
        done = subprocess.run(
            ["bash", str(CLUSTER_SH), "user-signal", value], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"cluster.sh user-signal {value}: {done.stderr}"

    user_signal("on")
    yield  # pytest comes back here whether the test passed or failed
    user_signal("off")


def trainfsm(*args: str) -> subprocess.CompletedProcess[str]:
    command = Path(sys.executable).with_name("trainfsm")
    argv = [str(command)] if command.exists() else [sys.executable, "-m", "trainfsm"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120)


def only(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [e for e in events if e["event"] == name]
    assert len(found) == 1, f"{len(found)} {name} events: {found}"
    return found[0]


def signals(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["signal"], e["at_state"]) for e in events if e["event"] == "signal_received"]


def assert_resumed_exactly(trial: Trial, job: dict[str, str]) -> tuple[list[dict[str, Any]], int]:
    """What every trial ends with: one requeue, the agreed step saved in the first attempt and loaded
    by the second, which completes; no event anywhere says something failed (ok=false); the audit
    exits 0 with a consistent trail of a run that ended well; the parameters are an uninterrupted
    run's. Returns the first attempt's events and the agreed step."""
    assert job["Restarts"] == "1" and job["ExitCode"] == "0:0", job
    trail = trial.events()
    assert {e["attempt"] for e in trail} == {0, 1}
    first, second = trial.attempt(0), trial.attempt(1)
    agreed = only(first, "signal_agreed")["agreed_step"]
    assert [e["saved_step"] for e in first if e["event"] == "checkpoint_saved"][-1] == agreed
    assert (first[-1]["event"], first[-1]["reason"]) == ("exit", "preempted")
    assert only(second, "run_start")["slurm"]["restart_count"] == 1
    assert only(second, "checkpoint_loaded")["from_step"] == agreed  # the agreed step's, not an older one
    assert (second[-1]["event"], second[-1]["reason"], second[-1]["code"]) == ("exit", "completed", 0)
    assert signals(second) == []  # the high job's preemption was over: nothing came
    assert [e for e in trail if e.get("ok") is False] == []

    done = trainfsm("audit", "--json", str(trial.workspace))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["consistent"] and report["ended_well"], report["problems"] + report["run_problems"]
    assert trial.same_as_uninterrupted()
    return first, agreed


def assert_timed(first: list[dict[str, Any]], applied: str, kill_start: float, workspace: Path) -> dict[str, Any]:
    """The trail's ``job_end`` (rank 0 read the job after the preemption) and the audit's preemption
    entry: the deadline that applied, SLURM's SIGKILL ``KillWait`` after ``kill_start``, and the
    margin the exit left before it. Returns the entry."""
    job_end = only(first, "job_end")
    assert job_end["applied"] == applied
    assert job_end["kill_start"] == pytest.approx(kill_start, abs=1e-3)
    assert job_end["kill_wait"] == KILL_WAIT
    assert job_end["kill_at"] == pytest.approx(kill_start + KILL_WAIT, abs=1e-3)
    timing: dict[str, Any] = audit.audit([workspace]).attempts[0].as_dict()["preemption"]
    assert (timing["applied"], timing["kill_wait"], timing["job_end_read"]) == (applied, KILL_WAIT, "signal")
    assert timing["job_end"] == job_end["kill_at"]
    assert timing["margin"] == pytest.approx(job_end["kill_at"] - first[-1]["ts"], abs=1e-3)
    assert timing["margin"] > 0
    text = trainfsm("audit", str(workspace))
    [line] = [line.strip() for line in text.stdout.splitlines() if line.strip().startswith("preemption:")]
    print(line)
    said = {"grace_time": "the grace time's end", "kill_wait": "SLURM's kill had begun: the signal"}[applied]
    assert re.search(rf"; deadline \+\d+\.\d s \({said} \+ KillWait 10 s\), margin \d+\.\d s at exit$", line), line
    return timing


def assert_noticed(first: list[dict[str, Any]], mode: str, limited: bool = True) -> dict[str, Any]:
    """No signal came with the preemption: rank 0 saw the job's ``PreemptTime`` at its next read
    (every ``PREEMPTED_REREAD_FLOOR`` s; PreemptTime is whole seconds) and the run left as for the
    exit policy's first signal, SIGTERM; the trainer's requeue brought SLURM's SIGTERM, in EXIT.
    The grace time ends ``GraceTime`` after ``PreemptTime``: SLURM's ``EndTime`` of a job with a
    time limit (``limited``); a job without one has none (Unknown)."""
    preempted = only(first, "preempted")
    assert (preempted["mode"], preempted["grace_time"]) == (mode, GRACE_TIME)
    assert preempted["grace_end"] == preempted["preempt_time"] + GRACE_TIME
    assert 0 <= preempted["noticed_at"] - preempted["preempt_time"] <= PREEMPTED_REREAD_FLOOR + 2
    agreed = only(first, "signal_agreed")
    assert (agreed["signal"], agreed["reason"]) == ("SIGTERM", "preemption")
    assert signals(first) == [("SIGTERM", "EXIT")]
    requeue = only(first, "requeue")
    assert (requeue["ok"], requeue["requeued_by"]) == (True, "trainer")
    assert (first[-1]["reason"], first[-1]["code"]) == ("preempted", 143)
    job_end = only(first, "job_end")
    assert (job_end["after"], job_end["job_state"], job_end["restarts"]) == ("preemption", "RUNNING", 0)
    assert job_end["end_time"] == (preempted["grace_end"] if limited else None)
    return preempted


# Short steps and few of them: the preempted attempt leaves within a second of its signal, or within
# PREEMPTED_REREAD_FLOOR of the preemption; the resumed one trains the rest without sleeping.
SHORT = ("--steps", "200", "--interval", "50", "--step-seconds", "0.1")


@pytest.mark.slow
def test_with_the_user_signal_a_preempted_job_saves_at_once_and_requeues_itself(
    slurm_cluster: SlurmCluster, trial: Trial, user_signal: None
) -> None:
    """REQUEUE, GraceTime 30, ``preempt_send_user_signal``: the job's ``--signal`` (SIGUSR1) comes
    the moment the high job is submitted; the trainer saves the step, requeues the job itself (SLURM
    would only at the grace time's end) and exits 138; SLURM's SIGTERM for that requeue is in the
    trail, in EXIT. The deadline that applied is the grace time's end."""
    job_id = trial.submit("low", *SHORT, options=("--time=10", "--signal=B:USR1@60"))
    trial.training()
    trial.preempt()
    job = trial.completed(job_id)
    first, _ = assert_resumed_exactly(trial, job)

    usr1 = next(e for e in first if e["event"] == "signal_received")
    assert usr1["received_at"] - trial.preempted_at < SCHEDULED_WITHIN
    job_end = only(first, "job_end")
    assert 0 <= usr1["received_at"] - (job_end["end_time"] - GRACE_TIME) < 1.5  # at once (PreemptTime: whole s)
    assert signals(first) == [("SIGUSR1", usr1["at_state"]), ("SIGTERM", "EXIT")]
    assert only(first, "signal_agreed")["signal"] == "SIGUSR1"
    requeue = only(first, "requeue")
    assert (requeue["ok"], requeue["requeued_by"]) == (True, "trainer")
    assert requeue["command"] == f"scontrol requeue {job_id}"
    assert (first[-1]["reason"], first[-1]["code"]) == ("preempted", 138)
    assert (job_end["job_state"], job_end["restarts"]) == ("RUNNING", 0)
    assert_timed(first, "grace_time", job_end["end_time"], trial.workspace)


@pytest.mark.slow
def test_without_the_user_signal_a_preempted_job_notices_the_preemption_and_requeues_itself(
    slurm_cluster: SlurmCluster, trial: Trial
) -> None:
    """REQUEUE, GraceTime 30, no user signal: nothing reaches the process until the grace time is
    over, so rank 0 notices the job's ``PreemptTime`` (``preempted``), well within the grace time;
    the run saves, the trainer requeues the job (SLURM would only at the grace time's end) and
    exits 143. The deadline that applied is the grace time's end."""
    job_id = trial.submit("low", *SHORT)
    trial.training()
    trial.preempt()
    job = trial.completed(job_id)
    first, _ = assert_resumed_exactly(trial, job)
    preempted = assert_noticed(first, "REQUEUE")
    timing = assert_timed(first, "grace_time", preempted["grace_end"], trial.workspace)
    assert timing["cause"] == "preemption" and timing["exit"] < GRACE_TIME


@pytest.mark.slow
def test_a_job_preemption_cancels_is_requeued_by_the_trainer_and_completes(
    slurm_cluster: SlurmCluster, trial: Trial
) -> None:
    """CANCEL, GraceTime 30, no user signal: as under REQUEUE, rank 0 notices the preemption and the
    run saves; the trainer's ``scontrol requeue`` within the grace time turns SLURM's cancel into a
    requeue, and the job ends COMPLETED, not PREEMPTED. The job has no time limit: its ``EndTime``
    stays Unknown at the preemption, and the grace time's end is ``PreemptTime`` + ``GraceTime``."""
    job_id = trial.submit("low-cancel", *SHORT, options=())
    trial.training()
    # A job submitted without --time has none (TimeLimit=UNLIMITED), unless SLURM's backfill
    # scheduler started it, which gives it a year: none, as the main scheduler leaves it.
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=UNLIMITED")
    trial.preempt()
    job = trial.completed(job_id)
    first, _ = assert_resumed_exactly(trial, job)
    preempted = assert_noticed(first, "CANCEL", limited=False)
    timing = assert_timed(first, "grace_time", preempted["grace_end"], trial.workspace)
    assert timing["cause"] == "preemption" and timing["exit"] < GRACE_TIME


def test_with_no_grace_time_slurm_requeues_the_job_itself_and_no_requeue_failed(
    slurm_cluster: SlurmCluster, trial: Trial
) -> None:
    """REQUEUE, GraceTime 0: SIGTERM the moment the high job is submitted, and SLURM requeues the
    job at once (COMPLETING, Restarts=1). The run saves within KillWait; rank 0 sees the requeue done
    (``requeue`` ok, ``requeued_by="slurm"``) and records no failure, so ``trainfsm audit`` run
    between the attempts finds nothing wrong (no ``requeue_refused``), and ``trace`` says it was
    done by SLURM. The deadline that applied is the signal + KillWait."""
    job_id = trial.submit("low-nograce", *SHORT)
    trial.training()
    trial.preempt()
    trial.wait_for(lambda: any(e["event"] == "exit" for e in trial.attempt(0)), 60, "the first attempt's exit")
    between = trainfsm("audit", "--json", str(trial.workspace))
    assert between.returncode == 0, between.stdout + between.stderr
    report = json.loads(between.stdout)
    assert [a["attempt"] for a in report["attempts"]] == [0]  # the second attempt had not begun
    assert report["run_problems"] == [] and report["ended_well"], report["run_problems"]

    job = trial.completed(job_id)
    first, _ = assert_resumed_exactly(trial, job)
    sigterm = next(e for e in first if e["event"] == "signal_received")
    assert sigterm["received_at"] - trial.preempted_at < SCHEDULED_WITHIN  # at once
    assert signals(first) == [("SIGTERM", sigterm["at_state"])] and sigterm["at_state"] != "EXIT"
    agreed = only(first, "signal_agreed")
    assert (agreed["signal"], agreed["reason"]) == ("SIGTERM", "signal")
    assert not [e for e in first if e["event"] == "preempted"]
    requeue = only(first, "requeue")
    assert (requeue["ok"], requeue["requeued_by"]) == (True, "slurm"), requeue
    assert (first[-1]["reason"], first[-1]["code"]) == ("preempted", 143)
    job_end = only(first, "job_end")
    assert (job_end["after"], job_end["job_state"], job_end["restarts"]) == ("signal", "COMPLETING", 1)
    assert_timed(first, "kill_wait", sigterm["received_at"], trial.workspace)

    trace = trainfsm("trace", str(trial.workspace))
    assert trace.returncode == 0, trace.stdout + trace.stderr
    assert re.search(r"requeue: done by SLURM: ", trace.stdout), trace.stdout


@pytest.mark.slow
def test_with_30_s_steps_and_no_user_signal_the_agreed_step_is_saved_within_the_grace_time(
    slurm_cluster: SlurmCluster, trial: Trial
) -> None:
    """The acceptance trial (issue 47): REQUEUE, GraceTime 30, no user signal, steps of 30 s, the
    high job submitted 2 s into a step, after an interval's checkpoint. The step in flight ends 28 s
    after the preemption: only a trainer that noticed the ``PreemptTime`` during it agrees on that
    step and saves it before the grace time's end; one that waits for SLURM's SIGTERM (the grace
    time's end, on slurmctld's 30 s tick) starts the next step and is killed in it, ``KillWait``
    later, and the next attempt resumes from the interval's checkpoint. The resumed attempt's
    steps take no time."""
    job_id = trial.submit(
        "low", "--steps", "6", "--interval", "2", "--step-seconds", "30", "--resumed-step-seconds", "0"
    )
    trial.wait_for(
        lambda: any(e.get("step") == 3 for e in trial.attempt(0)), 150, "step 3 to begin, after the interval's save"
    )
    began = next(e["ts"] for e in trial.attempt(0) if e.get("step") == 3)
    time.sleep(max(0.0, began + 2 - time.time()))
    trial.preempt()
    job = trial.completed(job_id, timeout=240)
    first, agreed = assert_resumed_exactly(trial, job)
    assert agreed == 3
    assert [e["saved_step"] for e in first if e["event"] == "checkpoint_saved"] == [2, 3]
    preempted = assert_noticed(first, "REQUEUE")
    saved = [e for e in first if e["event"] == "checkpoint_saved"][-1]
    assert saved["ts"] < preempted["grace_end"], f"saved {saved['ts'] - preempted['grace_end']:.2f} s after"
    timing = assert_timed(first, "grace_time", preempted["grace_end"], trial.workspace)
    print(
        f"preempted {trial.preempted_at - began:.2f} s into step 3; noticed +{timing['noticed']:.2f} s, step finished "
        f"+{timing['step_finished']:.2f} s, durable +{timing['durable']:.2f} s, the grace time's end "
        f"+{GRACE_TIME:g} s; margin {timing['margin']:.1f} s at exit"
    )
