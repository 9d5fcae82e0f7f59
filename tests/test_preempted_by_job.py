"""Preemption by another job (issue 47) without a cluster: what rank 0 reads from ``scontrol`` (the
lines SLURM 22.05.8 printed on the project's cluster, in tests/data/scontrol-22.05.8/), how it
follows the job (``JobEnd``), and a real trainer under the stand-in ``scontrol`` of
``tests.fake_slurm``: a ``PreemptTime`` takes the run out within the grace time, a requeue SLURM did
itself is no failure, and the signals of EXIT are in the trail. The real preemptions are in
tests/slurm/."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli_helpers import audit_json, cli
from tests.distributed.launch import ROOT, events, free_port
from tests.fake_slurm import PENDING_EXECUTION, FakeSlurm
from tests.helpers import Slow, TinyTrainer, parameters, read_events
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.preemption import deadline, slurm
from trainfsm.preemption.slurm import (
    JobEnd,
    JobView,
    KillDeadline,
    SlurmJob,
    deadline_after,
    kill_wait,
    parse_job,
    parse_partition,
    requeued_by_slurm,
    reread_seconds,
)
from trainfsm.tools import audit

DATA = Path(__file__).parent / "data" / "scontrol-22.05.8"
READ_AT = 1795779500.0


def shown(name: str) -> str:
    """What ``scontrol show ... -o`` printed on the project's cluster (SLURM_TIME_FORMAT=%s)."""
    return (DATA / f"{name}.txt").read_text()


def job(restarts: int = 0, job_id: str = "20", **fields: Any) -> SlurmJob:
    """The job as rank 0 knows it from the start of this attempt (``SLURM_RESTART_COUNT``): by
    default job 20 of the lines in tests/data/, 4242 for the stand-in ``scontrol``."""
    return SlurmJob(job_id, None, None, restarts, None, None, **fields)


def in_partition(name: str, restarts: int = 0) -> SlurmJob:
    """Job 20 in one of the project's partitions, as ``with_job_details`` reads it at the start."""
    found = parse_partition(name, shown(f"partition-{name}"))
    return job(restarts, partition=name, preempt_mode=found.preempt_mode, grace_time=found.grace_time)


# ---------------------------------------------------------------- scontrol's lines
def test_a_running_job_not_preempted_has_no_preempt_time() -> None:
    """``PreemptEligibleTime`` comes first on the line and has a time: only ``PreemptTime`` counts."""
    view = parse_job(shown("job-running"), READ_AT)
    assert view == JobView(READ_AT, 1795780023.0, "RUNNING", 0, None, "low", batch=True)


def test_a_job_preempted_in_its_grace_time_has_a_preempt_time_and_its_end_at_the_graces_end() -> None:
    """As SLURM chose it for preemption (``low``: GraceTime 30): still RUNNING, ``EndTime`` moved."""
    view = parse_job(shown("job-preempted-in-grace"), READ_AT)
    assert view == JobView(READ_AT, 1795779454.0, "RUNNING", 0, 1795779424.0, "low", batch=True)
    assert view.end_time == view.preempt_time + 30  # type: ignore[operator]


def test_a_job_slurm_requeued_is_completing_with_restarts_1_and_its_next_end() -> None:
    """At the grace time's end under ``PreemptMode=REQUEUE``: COMPLETING, Restarts=1 already, no
    ``PreemptTime`` field, and ``EndTime`` the requeued job's: now + its time limit."""
    view = parse_job(shown("job-completing-requeued"), READ_AT)
    assert view == JobView(READ_AT, 1795780064.0, "COMPLETING", 1, None, "low", batch=True)


def test_a_requeued_job_pending_has_no_end() -> None:
    view = parse_job(shown("job-pending-requeued"), READ_AT)
    assert view == JobView(READ_AT, None, "PENDING", 1, None, "low", batch=True)


def test_a_cancelled_preemption_is_completing_with_restarts_0() -> None:
    """``PreemptMode=CANCEL`` at the grace time's end: COMPLETING, no restart, ``PreemptTime`` moved
    to the kill."""
    view = parse_job(shown("job-completing-cancelled"), READ_AT)
    assert view == JobView(READ_AT, 1795779386.0, "COMPLETING", 0, 1795779386.0, "low-cancel", batch=True)


@pytest.mark.parametrize(
    ("name", "mode", "grace", "preempts_with_grace"),
    [
        ("low", "REQUEUE", 30.0, True),
        ("low-cancel", "CANCEL", 30.0, True),
        ("low-nograce", "REQUEUE", 0.0, False),
        ("debug", "OFF", 0.0, False),
        ("high", "OFF", 0.0, False),
    ],
)
def test_a_partitions_preempt_mode_and_grace_time_are_read(
    name: str, mode: str, grace: float, preempts_with_grace: bool
) -> None:
    found = parse_partition(name, shown(f"partition-{name}"))
    assert (found.name, found.preempt_mode, found.grace_time) == (name, mode, grace)
    assert found.preempts_with_grace is preempts_with_grace


def test_a_suspending_partition_does_not_preempt_with_grace() -> None:
    """``GANG,SUSPEND`` (as SLURM prints a partition that suspends; the line is ``low``'s with that
    mode): the job is suspended, not ended, so its grace time asks for no save."""
    line = shown("partition-low").replace("PreemptMode=REQUEUE", "PreemptMode=GANG,SUSPEND")
    found = parse_partition("low", line)
    assert (found.preempt_mode, found.grace_time, found.preempts_with_grace) == ("GANG,SUSPEND", 30.0, False)


def test_kill_wait_is_read_from_show_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster's whole ``scontrol show config``: ``KillWait = 10 sec`` (not ``KillOnBadExit``
    just before it); no scontrol answer, or none on PATH: not known."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\ncat {DATA / 'config.txt'}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert kill_wait() == 10.0
    scontrol.write_text("#!/bin/sh\necho 'slurm_load_ctl_conf error: Unable to contact slurm controller' >&2\nexit 1\n")
    assert kill_wait() is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert kill_wait() is None


# ---------------------------------------------------------------- how often rank 0 reads the job
@pytest.mark.parametrize(
    ("partition", "mode", "grace", "seconds"),
    [
        ("low", "REQUEUE", 30.0, 10.0),  # a third of the grace time
        ("low", "REQUEUE", 60.0, 20.0),
        ("low", "REQUEUE", 600.0, 60.0),  # never less often than the minute every job is read
        ("low", "REQUEUE", 15.0, 10.0),  # never more often than the floor
        ("low-cancel", "CANCEL", 30.0, 10.0),
        ("low-nograce", "REQUEUE", 0.0, 60.0),  # no grace time to use: SLURM's SIGTERM is the notice
        ("debug", "OFF", 30.0, 60.0),  # a grace time, but the partition never preempts
        ("low", "GANG,SUSPEND", 30.0, 60.0),  # suspended, not ended: nothing to save
        (None, None, None, 60.0),  # SLURM did not say
    ],
)
def test_rank_0_reads_the_job_every_third_of_a_grace_time_it_may_use_else_every_minute(
    partition: str | None, mode: str | None, grace: float | None, seconds: float
) -> None:
    assert reread_seconds(job(partition=partition, preempt_mode=mode, grace_time=grace)) == seconds


def test_the_read_floor_and_the_minute_are_the_modules_constants() -> None:
    assert (slurm.PREEMPTED_REREAD_FLOOR, slurm.REREAD_SECONDS) == (10.0, 60.0)
    assert reread_seconds(in_partition("low")) == 10.0 and reread_seconds(in_partition("debug")) == 60.0


# ---------------------------------------------------------------- who requeued the job
def test_restarts_that_grew_since_the_attempt_began_mean_slurm_requeued_the_job() -> None:
    completing = parse_job(shown("job-completing-requeued"), READ_AT)  # Restarts=1
    assert requeued_by_slurm(completing, job(restarts=0))
    assert requeued_by_slurm(parse_job(shown("job-pending-requeued"), READ_AT), job(restarts=0))


def test_restarts_as_at_the_start_or_unknown_or_no_read_are_not_a_requeue_by_slurm() -> None:
    """The requeued job's own next attempt (``SLURM_RESTART_COUNT=1``) reads Restarts=1: nothing
    happened since it began. A line without ``Restarts``, or no line at all, says nothing."""
    assert not requeued_by_slurm(parse_job(shown("job-running-again"), READ_AT), job(restarts=1))
    assert not requeued_by_slurm(parse_job(shown("job-preempted-in-grace"), READ_AT), job(restarts=0))
    assert not requeued_by_slurm(parse_job("JobId=20 JobState=COMPLETING EndTime=Unknown", READ_AT), job())
    assert not requeued_by_slurm(None, job())


# ---------------------------------------------------------------- the deadline that applied
def test_preempted_in_its_grace_time_the_deadline_is_the_graces_end_plus_kill_wait() -> None:
    view = parse_job(shown("job-preempted-in-grace"), READ_AT)
    signal_at = 1795779430.0  # six seconds into the grace time
    assert deadline_after(view, job(), signal_at, 10.0) == KillDeadline("grace_time", 1795779454.0, 10.0, 1795779464.0)


@pytest.mark.parametrize("name", ["job-completing-requeued", "job-completing-cancelled", "job-pending-requeued"])
def test_a_job_no_longer_running_had_its_kill_begun_at_the_signal(name: str) -> None:
    """SLURM's SIGTERM at the grace time's end (or a requeue, a cancel): the job is COMPLETING (or
    already PENDING): SIGKILL comes ``KillWait`` after the signal, whatever the line's end says."""
    signal_at = 1795779464.5
    found = deadline_after(parse_job(shown(name), READ_AT), job(), signal_at, 10.0)
    assert found == KillDeadline("kill_wait", signal_at, 10.0, signal_at + 10.0)


def test_a_job_running_again_after_slurms_requeue_had_its_kill_begun_at_the_signal() -> None:
    """Read late, the job already runs its next attempt (RUNNING, Restarts=1, a new end an hour on):
    the grown ``Restarts`` says this attempt's kill began at the signal, not the new end."""
    signal_at = 1795779464.5
    found = deadline_after(parse_job(shown("job-running-again"), READ_AT), job(restarts=0), signal_at, 10.0)
    assert found == KillDeadline("kill_wait", signal_at, 10.0, signal_at + 10.0)


def test_a_sigterm_at_the_time_limit_is_slurms_kill_but_another_signal_there_is_not() -> None:
    """The limit's SIGTERM comes at ``EndTime`` (within a second): the kill had begun. A SIGUSR1 at
    the same instant (``--signal=USR1@0``) is the warning before it: the time limit applied."""
    view = parse_job(shown("job-running"), READ_AT)  # EndTime=1795780023
    at_limit = 1795780022.5
    assert deadline_after(view, job(), at_limit, 10.0, sigterm=True) == KillDeadline(
        "kill_wait", at_limit, 10.0, at_limit + 10.0
    )
    assert deadline_after(view, job(), at_limit, 10.0, sigterm=False) == KillDeadline(
        "time_limit", 1795780023.0, 10.0, 1795780033.0
    )


def test_a_signal_well_before_the_time_limit_has_the_time_limit_as_its_deadline() -> None:
    view = parse_job(shown("job-running"), READ_AT)
    found = deadline_after(view, job(), 1795779500.0, 10.0, sigterm=True)  # SIGTERM 523 s before the end
    assert found == KillDeadline("time_limit", 1795780023.0, 10.0, 1795780033.0)


def test_no_limit_or_no_read_is_no_deadline() -> None:
    unlimited = shown("job-running").replace("TimeLimit=00:10:00", "TimeLimit=UNLIMITED")
    assert deadline_after(parse_job(unlimited, READ_AT), job(), 1795779500.0, 10.0) is None
    assert deadline_after(None, job(), 1795779500.0, 10.0) is None


def test_kill_wait_not_known_puts_the_deadline_at_the_kill_itself() -> None:
    view = parse_job(shown("job-preempted-in-grace"), READ_AT)
    found = deadline_after(view, job(), 1795779430.0, None)
    assert found == KillDeadline("grace_time", 1795779454.0, None, 1795779454.0)


# ---------------------------------------------------------------- JobEnd: the job followed on a thread
@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    return FakeSlurm(tmp_path / "slurm", monkeypatch)


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


def show_job_reads(fake: FakeSlurm) -> int:
    return sum(1 for c in fake.calls() if c == "%s|show job -o 4242")


class Taker:
    """``on_preempted``: records each offer (when, what, and how many reads of the job SLURM had
    answered by then); refuses the first ``refuse`` of them, as the trainer does while its exit
    policy is not known."""

    def __init__(self, fake: FakeSlurm, refuse: int = 0) -> None:
        self.fake, self.refuse = fake, refuse
        self.offers: list[tuple[float, JobView, int]] = []

    def __call__(self, view: JobView) -> bool:
        self.offers.append((time.monotonic(), view, show_job_reads(self.fake)))
        return len(self.offers) > self.refuse


def test_a_preempt_time_read_is_handed_over_once(fake_slurm: FakeSlurm) -> None:
    """Read every 50 ms: the read that shows a ``PreemptTime`` hands the job to ``on_preempted``;
    the reads after it (the end is still followed) hand nothing more."""
    fake_slurm.end_in(3600.0)
    taker = Taker(fake_slurm)
    followed = JobEnd(job(job_id="4242", end_time=3600.0), every=0.05, on_preempted=taker)
    followed.start()
    try:
        time.sleep(0.2)
        assert taker.offers == []  # reads without a PreemptTime hand nothing over
        preempt_time = fake_slurm.preempt(grace_time=30)
        wait_until(lambda: taker.offers)
        reads = show_job_reads(fake_slurm)
        wait_until(lambda: show_job_reads(fake_slurm) >= reads + 4)
    finally:
        followed.stop()
    [(_, view, _)] = taker.offers
    assert (view.preempt_time, view.end_time, view.state) == (preempt_time, preempt_time + 30, "RUNNING")
    assert followed.preempted is view and followed.end_time == preempt_time + 30


def test_a_preemption_the_trainer_cannot_take_yet_is_offered_again_every_quarter_second(
    fake_slurm: FakeSlurm,
) -> None:
    """``on_preempted`` says False (the exit policy is not known before the end of BUILD): the same
    view is offered again every 0.25 s until it says True; then never. The reads go on meanwhile
    (the job's end stays current for the deadline)."""
    fake_slurm.end_in(3600.0)
    preempt_time = fake_slurm.preempt(grace_time=30)
    taker = Taker(fake_slurm, refuse=3)
    followed = JobEnd(job(job_id="4242", end_time=3600.0), every=0.05, on_preempted=taker)
    followed.start()
    try:
        wait_until(lambda: len(taker.offers) == 4)
        reads = show_job_reads(fake_slurm)
        time.sleep(0.6)
    finally:
        followed.stop()
    assert len(taker.offers) == 4 and show_job_reads(fake_slurm) > reads  # reading went on, offering did not
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(taker.offers)]
    assert all(0.24 <= gap < 1.0 for gap in gaps), gaps
    counts = [reads for _, _, reads in taker.offers]
    assert counts == sorted(set(counts))  # a read between two offers
    assert len({id(view) for _, view, _ in taker.offers}) == 1 and taker.offers[0][1].preempt_time == preempt_time
    assert followed.preempted is taker.offers[0][1]


def test_a_preempt_time_there_when_train_began_is_handed_over_at_once(fake_slurm: FakeSlurm) -> None:
    """``with_job_details`` read a ``PreemptTime`` at the start: the first offer comes a quarter of a
    second after ``start``, not a read (a minute) later, and without another read."""
    preempt_time = fake_slurm.preempt(grace_time=30)
    started = job(job_id="4242", end_time=preempt_time + 30, preempt_time=preempt_time)
    taker = Taker(fake_slurm)
    followed = JobEnd(started, every=60.0, on_preempted=taker)
    began = time.monotonic()
    followed.start()
    try:
        wait_until(lambda: taker.offers, timeout=2.0)
    finally:
        followed.stop()
    [(at, view, _)] = taker.offers
    assert at - began < 1.0
    assert (view.preempt_time, view.end_time) == (preempt_time, preempt_time + 30)
    assert fake_slurm.calls() == []


# ---------------------------------------------------------------- a real run, preempted by another job
@pytest.fixture
def quick_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny CPU run exits in well under a second: plan half a second for it, not EXIT_SECONDS."""
    monkeypatch.setattr(deadline, "EXIT_SECONDS", 0.5)


#: The stand-in partition's grace time (whole seconds, as SLURM has it): a third of it, 2 s, is how
#: often rank 0 reads the job once the floor allows it (``read_often``), which leaves a busy test
#: machine 4 s of it for the step in flight, the save and the way out.
GRACE = 6


@pytest.fixture
def read_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor of ``reread_seconds`` at a quarter of a second (10 s in a real run), so that a
    partition with a grace time of a few seconds is read every third of it: seconds for a test."""
    monkeypatch.setattr(slurm, "PREEMPTED_REREAD_FLOOR", 0.25)


@pytest.fixture
def low(fake_slurm: FakeSlurm) -> FakeSlurm:
    """Job 4242 in ``low`` (``PreemptMode=REQUEUE``, a grace time), an hour before its end; KillWait 10."""
    fake_slurm.end_in(3600.0)
    fake_slurm.add_partition("low", "REQUEUE", GRACE)
    fake_slurm.set_job(Partition="low")
    fake_slurm.set_kill_wait(10)
    return fake_slurm


#: The exit policy of these runs: SIGUSR1 first, so that leaving "as if by the first signal" shows as
#: 138 and SIGUSR1, and SLURM's SIGTERM after the requeue is one of its signals (recorded, not fatal).
EXIT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def trainer(workspace: Path, steps: int = 1000, slow: float = 0.01, at_step: Any = None, **kwargs: Any) -> TinyTrainer:
    policy = {key: kwargs.pop(key) for key in ("exit_wait", "requeue") if key in kwargs}
    saves = CheckpointingHook(interval=100_000, exit_signals=list(EXIT_SIGNALS), **policy)
    kwargs.setdefault("job_end_margin", None)  # the job's end is not what these runs are about
    return TinyTrainer(max_steps=steps, workspace=workspace, hooks=[saves, Slow(slow, at_step)], **kwargs)


def leaves(run: TinyTrainer) -> int:
    with pytest.raises(SystemExit) as info:
        run.train()
    assert isinstance(info.value.code, int)
    return info.value.code


def named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


@pytest.mark.usefixtures("quick_exit", "read_often")
def test_a_preempt_time_takes_the_run_out_at_the_next_step_end_within_the_grace_time(
    tmp_path: Path, low: FakeSlurm
) -> None:
    """At step 3 SLURM chooses the job for preemption (``PreemptTime``, the end moved to the grace
    time's end) and signals nothing, as it does an ``exec python`` batch job. Rank 0's next read
    sees it; the step in flight ends, the run agrees to leave as if by the policy's first signal
    (reason ``preemption``), saves that step, records the deadline that applied (the grace time's
    end + KillWait), requeues the job itself and exits 138, all before the grace time is over."""
    workspace = tmp_path / "run"
    chosen: list[float] = []
    code = leaves(trainer(workspace, at_step={3: lambda: chosen.append(low.preempt(GRACE))}))
    events = read_events(workspace)
    [preempt_time] = chosen
    grace_end = preempt_time + GRACE
    assert code == 128 + signal.SIGUSR1
    [preempted] = named(events, "preempted")
    [agreed] = named(events, "signal_agreed")
    names = [e["event"] for e in events]
    assert names.index("preempted") + 1 == names.index("signal_agreed")
    assert (preempted["preempt_time"], preempted["grace_end"], preempted["grace_time"], preempted["mode"]) == (
        preempt_time,
        grace_end,
        float(GRACE),
        "REQUEUE",
    )
    assert preempted["read_at"] <= preempted["noticed_at"] <= agreed["step_ended_at"] <= agreed["ts"]
    assert agreed["step_ended_at"] - preempted["noticed_at"] < 0.5  # the step in flight, not a later one
    assert (agreed["signal"], agreed["reason"], agreed["agreed_step"]) == ("SIGUSR1", "preemption", preempted["step"])
    assert [e["saved_step"] for e in named(events, "checkpoint_saved")] == [agreed["agreed_step"]]
    assert named(events, "checkpoint_saved")[0]["ts"] < grace_end
    [job_end] = named(events, "job_end")
    assert (job_end["after"], job_end["applied"], job_end["kill_start"], job_end["kill_wait"]) == (
        "preemption",
        "grace_time",
        grace_end,
        10.0,
    )
    assert (job_end["kill_at"], job_end["job_state"], job_end["restarts"]) == (grace_end + 10, "RUNNING", 0)
    [requeue] = named(events, "requeue")
    assert (requeue["ok"], requeue["requeued_by"], requeue["command"]) == (True, "trainer", "scontrol requeue 4242")
    assert low.requeued() == ["4242"]
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["code"]) == ("exit", "preempted", 138)
    assert events[-1]["ts"] < grace_end


@pytest.mark.usefixtures("quick_exit")
def test_a_job_chosen_for_preemption_before_train_began_leaves_without_waiting_for_a_read(
    tmp_path: Path, low: FakeSlurm
) -> None:
    """SLURM chose the job while it was starting (a ``PreemptTime`` in the start's read). With a
    grace time of 30 s rank 0 would read the job again only 10 s later; the start's read is handed
    over a quarter of a second after rank 0 begins to follow the job, and the run leaves long before
    that: at the end of RESTORE if it is still there (``preempt``, nothing trained, nothing saved, as
    for a signal then), else at the end of the step in flight, with that step's checkpoint."""
    low.add_partition("low", "REQUEUE", 30)
    preempt_time = low.preempt(30)
    workspace = tmp_path / "run"
    assert leaves(trainer(workspace)) == 128 + signal.SIGUSR1
    events = read_events(workspace)
    assert events[0]["slurm"]["preempt_time"] == preempt_time
    [preempted] = named(events, "preempted")
    [restored] = named(events, "restore")
    assert preempted["preempt_time"] == preempt_time and preempted["read_at"] < restored["ts"]
    assert events[-1]["event"] == "exit" and events[-1]["ts"] - restored["ts"] < 3.0
    saved = [e["saved_step"] for e in named(events, "checkpoint_saved")]
    agreed = named(events, "signal_agreed")
    if agreed:  # in the first steps
        assert agreed[0]["reason"] == "preemption" and saved == [agreed[0]["agreed_step"]]
    else:  # at the end of RESTORE
        [left] = [e for e in events if e["event"] == "transition" and e["trigger"] == "preempt"]
        assert (left["source"], left["step"], saved) == ("RESTORE", 0, [])
    reads = [c for c in low.calls() if c == "%s|show job -o 4242"]
    assert len(reads) == 2  # the start's, and the one after the notice (job_end): none in between


class SlowRestore(BaseHook):
    """RESTORE takes a second (a large checkpoint loading): the notice comes while it runs."""

    def on_enter_restore(self, trainer: BaseTrainer) -> None:
        time.sleep(1.0)


@pytest.mark.usefixtures("quick_exit")
def test_a_preemption_taken_in_restore_is_reported_as_slurms_not_as_the_sigterm_after_the_requeue(
    tmp_path: Path, low: FakeSlurm, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job was chosen before ``train()`` began and RESTORE is slow: the run leaves at the end
    of RESTORE (``preempt``), so no step agreed on anything. audit and trace still time it from
    ``PreemptTime`` as SLURM's preemption, not from SLURM's SIGTERM after the trainer's requeue (the
    one signal of the trail, which came last), and do not name that SIGTERM as the way out."""
    low.add_partition("low", "REQUEUE", 30)
    preempt_time = low.preempt(30)
    workspace = tmp_path / "run"
    run = trainer(workspace)
    run.hook_list.append(SlowRestore())
    assert leaves(run) == 128 + signal.SIGUSR1
    events = read_events(workspace)
    assert not named(events, "signal_agreed") and named(events, "checkpoint_saved") == []
    assert [e["signal"] for e in named(events, "signal_received")] == ["SIGTERM"]  # after the requeue
    [preempted] = named(events, "preempted")
    _, report = audit_json(capsys, workspace)
    timing = report["attempts"][0]["preemption"]
    assert (timing["cause"], timing["at"], timing["signal"], timing["agreed_step"]) == (
        "preemption",
        preempt_time,
        None,
        None,
    )
    assert timing["noticed"] == round(preempted["noticed_at"] - preempt_time, 3) and timing["noticed"] > 0
    code, out, _ = cli(capsys, "audit", workspace)
    assert code == 0, out
    [line] = [line.strip() for line in out.splitlines() if line.strip().startswith("preemption:")]
    assert line.startswith(
        "preemption: SLURM preempted the job (PreemptMode=REQUEUE, GraceTime 30 s), taken before training "
        "(nothing to save); noticed +"
    ), line
    code, out, _ = cli(capsys, "trace", workspace)
    assert code == 0 and f"  {line}\n" in out, out


@pytest.mark.usefixtures("quick_exit")
def test_a_grace_time_of_minutes_is_followed_with_the_deadline_off(
    tmp_path: Path, low: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GraceTime=600``: a third of it is more than the minute every followed job is read at, so
    rank 0 reads the job every minute (here a second: ``REREAD_SECONDS`` for a test). It still has
    to follow it with ``job_end_margin=None``, the deadline off: the grace time is there to use, as
    with a shorter one. (It once followed only a job read more often than every minute.)"""
    monkeypatch.setattr(slurm, "REREAD_SECONDS", 1.0)
    low.add_partition("low", "REQUEUE", 600)
    workspace = tmp_path / "run"
    code = leaves(trainer(workspace, steps=400, at_step={3: lambda: low.preempt(600)}, job_end_margin=None))
    events = read_events(workspace)
    assert code == 128 + signal.SIGUSR1
    [agreed] = named(events, "signal_agreed")
    assert agreed["reason"] == "preemption" and named(events, "preempted")[0]["grace_time"] == 600.0


@pytest.mark.usefixtures("quick_exit", "read_often")
def test_a_run_preempted_by_another_job_resumes_exactly(
    tmp_path: Path, low: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requeued job runs again (``SLURM_RESTART_COUNT=1``, no ``PreemptTime``): it resumes from
    the preemption's checkpoint and ends with an uninterrupted run's parameters."""
    workspace = tmp_path / "run"
    leaves(trainer(workspace, at_step={3: lambda: low.preempt(GRACE)}))
    low.set_job(PreemptTime=None, Restarts=1)
    low.end_in(3600.0)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    again = trainer(workspace, slow=0.0)
    again.train()
    [saved] = named(read_events(workspace), "checkpoint_saved")[:1]
    second = [e for e in read_events(workspace) if e["attempt"] == 1]
    [restored] = named(second, "restore")
    assert (restored["resumed"], restored["from_step"]) == (True, saved["saved_step"])
    assert (second[-1]["event"], second[-1]["reason"]) == ("exit", "completed") and not named(second, "preempted")
    straight = trainer(tmp_path / "straight", slow=0.0)
    straight.train()
    assert all(torch.equal(a, b) for a, b in zip(parameters(again), parameters(straight), strict=True))


@pytest.mark.usefixtures("quick_exit", "read_often")
def test_audit_says_slurm_preempted_the_job_and_the_deadline_was_the_graces_end_plus_kill_wait(
    tmp_path: Path, low: FakeSlurm, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = tmp_path / "run"
    leaves(trainer(workspace, at_step={3: lambda: low.preempt(GRACE)}))
    [agreed] = named(read_events(workspace), "signal_agreed")
    code, out, _ = cli(capsys, "audit", workspace)
    assert code == 0, out
    [line] = [line.strip() for line in out.splitlines() if line.strip().startswith("preemption:")]
    assert line.startswith(
        f"preemption: SLURM preempted the job (PreemptMode=REQUEUE, GraceTime {GRACE} s; exit as SIGUSR1), "
        f"agreed at step {agreed['agreed_step']}; noticed +"
    ), line
    assert "(the grace time's end + KillWait 10 s), margin " in line and line.endswith(" s at exit"), line
    assert "  requeue: done: " in out
    _, report = audit_json(capsys, workspace)
    timing = report["attempts"][0]["preemption"]
    assert (timing["cause"], timing["applied"], timing["kill_wait"]) == ("preemption", "grace_time", 10.0)
    assert timing["margin"] > 10.0  # left before the grace time was over: KillWait and more to spare


@pytest.mark.usefixtures("quick_exit", "read_often")
@pytest.mark.parametrize(
    ("mode", "every"),
    [("OFF", slurm.REREAD_SECONDS), ("REQUEUE", 1.0)],
    ids=["PreemptMode=OFF", "PreemptMode=REQUEUE"],
)
def test_rank_0_reads_the_job_every_minute_unless_its_partition_preempts_with_a_grace_time(
    tmp_path: Path, fake_slurm: FakeSlurm, mode: str, every: float
) -> None:
    """A 4 s run in a partition with a grace time of 3 s. With ``PreemptMode=OFF`` the job is read
    at the start only (the next read would be a minute on); in one that requeues, every second
    (a third of the grace time), and no more often: each read is a request to slurmctld."""
    fake_slurm.end_in(3600.0)
    fake_slurm.add_partition("part", mode, 3)
    fake_slurm.set_job(Partition="part")
    workspace = tmp_path / "run"
    began: list[float] = []
    hooks = [Slow(0.01, at_step={1: lambda: began.append(time.time())}), StopAfter(4.0)]
    TinyTrainer(max_steps=100_000, workspace=workspace, hooks=hooks, job_end_margin="auto").train()
    events = read_events(workspace)
    assert events[0]["slurm"]["preempt_mode"] == mode and events[-1]["reason"] == "stopped"
    reads = [at for at, call in fake_slurm.call_times() if call == "%s|show job -o 4242"]
    assert [call for _, call in fake_slurm.call_times() if "partition" in call] == ["%s|show partition -o part"]
    assert reads[0] < began[0]  # the start's read, in BUILD
    later = reads[1:]
    if every == slurm.REREAD_SECONDS:
        assert later == []
    else:
        gaps = [b - a for a, b in itertools.pairwise(later)]
        assert len(later) >= 2 and all(every - 0.05 <= gap < 2 * every for gap in gaps), gaps
        assert len(later) <= (events[-1]["ts"] - events[0]["ts"]) / every + 1


class StopAfter(BaseHook):
    """Ends the run (reason ``stopped``) ``seconds`` after its first step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.began: float | None = None

    def wants_stop(self, trainer: BaseTrainer) -> bool:
        if self.began is None:
            self.began = time.monotonic()
        return time.monotonic() - self.began > self.seconds


# ---------------------------------------------------------------- a requeue SLURM did itself
def sigusr1() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.usefixtures("quick_exit")
def test_a_requeue_slurm_already_did_is_done_by_slurm_and_exit_wait_is_not_slept(
    tmp_path: Path, fake_slurm: FakeSlurm
) -> None:
    """The trainer's ``scontrol requeue`` fails with "Job is pending execution" and SLURM then shows
    the job PENDING with Restarts=1: SLURM requeued it. The requeue is ok, ``requeued_by="slurm"``,
    its message says both; the run will resume, so ``exit_wait`` (30 s) is not slept."""
    fake_slurm.end_in(3600.0)
    fake_slurm.requeue_fails(PENDING_EXECUTION, JobState="PENDING", Restarts=1)
    workspace = tmp_path / "run"
    run = trainer(workspace, steps=20, at_step={3: sigusr1}, exit_wait=30, requeue=True)
    began = time.monotonic()
    code = leaves(run)
    took = time.monotonic() - began
    events = read_events(workspace)
    assert code == 138 and took < 10, took
    [requeue] = named(events, "requeue")
    assert (requeue["ok"], requeue["requeued_by"], requeue["command"]) == (True, "slurm", "scontrol requeue 4242")
    assert requeue["message"] == (
        "SLURM requeued the job itself (JobState=PENDING Restarts=1); "
        f"scontrol requeue said: {PENDING_EXECUTION} for job 4242"
    )
    assert fake_slurm.requeued() == [] and fake_slurm.calls().count("|requeue 4242") == 1
    assert (events[-1]["event"], events[-1]["code"]) == ("exit", 138)
    assert not named(events, "signal_received")[1:]  # SLURM's requeue was earlier: no SIGTERM waited for


@pytest.mark.usefixtures("quick_exit")
def test_a_job_slurm_requeued_before_the_read_after_the_signal_is_not_requeued_again(
    tmp_path: Path, fake_slurm: FakeSlurm
) -> None:
    """SLURM's SIGTERM at the grace time's end, the job already COMPLETING with Restarts=1 (as read
    on the cluster): the trainer runs no ``scontrol requeue``; the requeue event says SLURM did it,
    and the deadline that applied is that SIGTERM + KillWait."""
    fake_slurm.end_in(3600.0)
    fake_slurm.set_kill_wait(10)
    slurms_kill: list[float] = []

    def kill() -> None:
        fake_slurm.set_job(JobState="COMPLETING", Restarts=1)
        slurms_kill.append(time.time())
        os.kill(os.getpid(), signal.SIGTERM)

    workspace = tmp_path / "run"
    code = leaves(trainer(workspace, steps=20, at_step={3: kill}, exit_wait=30, requeue=True))
    events = read_events(workspace)
    assert code == 128 + signal.SIGTERM
    [requeue] = named(events, "requeue")
    assert (requeue["ok"], requeue["requeued_by"], requeue["command"]) == (True, "slurm", None)
    assert requeue["message"] == "SLURM requeued the job itself (JobState=COMPLETING Restarts=1)"
    assert not [c for c in fake_slurm.calls() if "requeue" in c]
    [received] = named(events, "signal_received")
    [job_end] = named(events, "job_end")
    assert (job_end["applied"], job_end["kill_start"], job_end["kill_at"]) == (
        "kill_wait",
        received["received_at"],
        received["received_at"] + 10.0,
    )
    assert (job_end["job_state"], job_end["restarts"]) == ("COMPLETING", 1)
    assert events[-1]["ts"] - received["received_at"] < 5  # exit_wait (30 s) not slept


@pytest.mark.usefixtures("quick_exit")
def test_audit_and_trace_say_slurm_requeued_the_job(
    tmp_path: Path, fake_slurm: FakeSlurm, capsys: pytest.CaptureFixture[str]
) -> None:
    """No later attempt in the trail yet: nothing failed (audit exits 0, no ``requeue_refused``), and
    trace says the job resumes when SLURM starts it."""
    fake_slurm.end_in(3600.0)
    fake_slurm.requeue_fails(PENDING_EXECUTION, JobState="PENDING", Restarts=1)
    workspace = tmp_path / "run"
    leaves(trainer(workspace, steps=20, at_step={3: sigusr1}, requeue=True))
    code, out, _ = cli(capsys, "audit", workspace)
    assert code == 0, out
    assert "  requeue: done by SLURM: SLURM requeued the job itself (JobState=PENDING Restarts=1); " in out
    _, report = audit_json(capsys, workspace)
    assert report["run_problems"] == [] and report["attempts"][0]["requeue"]["requeued_by"] == "slurm"
    code, out, _ = cli(capsys, "trace", workspace)
    assert code == 0, out
    assert "  requeue: done by SLURM: " in out
    assert (
        "  next: no later attempt in the trail yet; the job was requeued by SLURM and resumes when SLURM starts it"
        in out
    )


@pytest.mark.usefixtures("quick_exit")
def test_a_failed_requeue_with_restarts_unchanged_stays_a_failure(
    tmp_path: Path, fake_slurm: FakeSlurm, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guard: the same failure while SLURM still shows Restarts=0 (it did not requeue the job)
    is a failed requeue: ok=False, no ``requeued_by``, ``exit_wait`` slept, and audit's
    ``requeue_refused`` (exit 1)."""
    fake_slurm.end_in(3600.0)
    fake_slurm.requeue_fails(PENDING_EXECUTION)
    workspace = tmp_path / "run"
    run = trainer(workspace, steps=20, at_step={3: sigusr1}, exit_wait=1.0, requeue=True)
    began = time.monotonic()
    leaves(run)
    took = time.monotonic() - began
    events = read_events(workspace)
    [requeue] = named(events, "requeue")
    assert (requeue["ok"], requeue["requeued_by"]) == (False, None)
    assert requeue["message"] == f"{PENDING_EXECUTION} for job 4242"
    assert took >= 1.0
    code, report = audit_json(capsys, workspace)
    assert code == 1 and [p["kind"] for p in report["run_problems"]] == ["requeue_refused"]
    code, out, _ = cli(capsys, "audit", workspace)
    assert f"  requeue: FAILED: {PENDING_EXECUTION} for job 4242" in out


# ---------------------------------------------------------------- signals during EXIT
@pytest.mark.usefixtures("quick_exit")
def test_slurms_sigterm_after_the_trainers_requeue_is_in_the_trail_before_exit(
    tmp_path: Path, fake_slurm: FakeSlurm
) -> None:
    """SLURM answers a requeue with SIGTERM to the job, milliseconds later: the trainer waits for it
    (2 s at most) so that the trail has it, in EXIT, between ``requeue`` and ``exit``."""
    fake_slurm.end_in(3600.0)
    workspace = tmp_path / "run"
    assert leaves(trainer(workspace, steps=20, at_step={3: sigusr1}, requeue=True)) == 138
    events = read_events(workspace)
    received = named(events, "signal_received")
    assert [(e["signal"], e["at_state"]) for e in received] == [("SIGUSR1", "ACCUMULATE"), ("SIGTERM", "EXIT")]
    names = [e["event"] for e in events]
    assert names[-3:] == ["requeue", "signal_received", "exit"]
    assert fake_slurm.requeued() == ["4242"]


class SignalDuringExitWait(BaseHook):
    """0.5 s after the trail's ``exit`` line, SIGTERM from a thread: the process waits ``exit_wait`` then."""

    def __init__(self, trail: Path) -> None:
        self.trail = trail
        self.sent_at: float | None = None

    def on_after_train(self, trainer: BaseTrainer) -> None:
        threading.Thread(target=self._send, daemon=True).start()

    def _send(self) -> None:
        give_up = time.monotonic() + 10.0
        while '"event":"exit"' not in self.trail.read_text():
            if time.monotonic() > give_up:  # no exit line: no signal (after train() it would end pytest)
                return
            time.sleep(0.01)
        time.sleep(0.5)
        self.sent_at = time.time()
        os.kill(os.getpid(), signal.SIGTERM)


def exit_wait_run(workspace: Path) -> tuple[SignalDuringExitWait, float]:
    """A run outside SLURM (no requeue) preempted by SIGUSR1 at step 3, ``exit_wait=5``, and SIGTERM
    0.5 s into the wait; returns the hook and when ``train()`` returned."""
    hook = SignalDuringExitWait(workspace / "logs" / "events.rank0.jsonl")
    saves = CheckpointingHook(interval=100, exit_signals=list(EXIT_SIGNALS), exit_wait=5, requeue=False)
    run = TinyTrainer(max_steps=20, workspace=workspace, hooks=[saves, Slow(0.0, {3: sigusr1}), hook])
    assert leaves(run) == 138
    return hook, time.time()


def test_a_signal_during_exit_wait_cuts_it_short_and_is_recorded_after_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    workspace = tmp_path / "run"
    hook, returned = exit_wait_run(workspace)
    events = read_events(workspace)
    [exited] = named(events, "exit")
    last = events[-1]
    assert (last["event"], last["signal"], last["at_state"]) == ("signal_received", "SIGTERM", "EXIT")
    assert events[-2] is exited and exited["reason"] == "preempted"
    assert hook.sent_at is not None and exited["ts"] + 0.4 < hook.sent_at <= last["received_at"]
    assert returned - hook.sent_at < 2.5  # the wait ended with the signal, not 4.5 s later
    report = audit.audit([workspace])
    assert report.consistent and report.ended_well, report.problems
    assert not [p for p in report.problems if p.kind == "malformed"]


def test_another_event_after_exit_is_still_malformed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a signal may follow ``exit``: a checkpoint record there (copied from the same trail) is
    reported as malformed."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    workspace = tmp_path / "run"
    exit_wait_run(workspace)
    path = workspace / "logs" / "events.rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    [saved] = [line for line in lines if '"event":"checkpoint_saved"' in line]
    path.write_text("".join([*lines, saved]))
    report = audit.audit([workspace])
    malformed = [p for p in report.problems if p.kind == "malformed"]
    assert not report.consistent and len(malformed) == 1, report.problems
    assert "checkpoint_saved after the exit event of attempt 0" in malformed[0].message


# ---------------------------------------------------------------- the review's findings
@pytest.mark.usefixtures("quick_exit", "read_often")
def test_a_controller_silent_at_the_start_still_lets_a_preemption_be_noticed(tmp_path: Path, low: FakeSlurm) -> None:
    """slurmctld does not answer when ``train()`` begins (no end, no partition known), then answers
    again: rank 0 follows the job all the same (at the minute's rate until a read names the
    partition, then at its grace time's), so a later ``PreemptTime`` takes the run out."""
    low.controller_down()
    workspace = tmp_path / "run"

    def preempt() -> None:
        low.controller_down(False)
        low.preempt(GRACE)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slurm, "REREAD_SECONDS", 1.0)  # the minute, in a test's time
        code = leaves(trainer(workspace, steps=3000, at_step={3: preempt}))
    events = read_events(workspace)
    assert code == 128 + EXIT_SIGNALS[0]
    assert events[0]["slurm"]["partition"] is None  # the start's read failed
    [preempted] = named(events, "preempted")
    assert preempted["grace_time"] == GRACE and preempted["mode"] == "REQUEUE"  # learnt from a later read
    assert named(events, "signal_agreed")[0]["reason"] == "preemption"


def test_a_preempt_time_at_the_start_in_a_suspending_partition_is_not_taken_and_the_reads_go_on(
    fake_slurm: FakeSlurm,
) -> None:
    """A ``SUSPEND`` preemption stops the job and continues it later: nothing to save, so the
    ``PreemptTime`` SLURM set before ``train()`` began is not handed over, and the job's end is
    still read (a later ``scontrol update TimeLimit=`` is seen)."""
    fake_slurm.end_in(3600.0)
    job = slurm.SlurmJob(
        "4242", None, None, 0, None, None, end_time=time.time() + 3600.0, partition="low",
        preempt_mode="GANG,SUSPEND", grace_time=30.0, preempt_time=time.time() - 5,
    )  # fmt: skip
    offered: list[Any] = []
    follow = JobEnd(job, every=0.1, on_preempted=lambda view: offered.append(view) or True).start()
    try:
        later = fake_slurm.end_in(7200.0)
        deadline = time.monotonic() + 5
        while follow.end_time != later and time.monotonic() < deadline:
            time.sleep(0.05)
        assert follow.end_time == later
        assert offered == [] and follow.preempted is None
    finally:
        follow.stop()


def test_a_preemption_the_policy_cannot_take_does_not_stop_the_reads(fake_slurm: FakeSlurm) -> None:
    """``on_preempted`` says no (a policy without exit signals): the offer is repeated, and the
    job's end is still read meanwhile."""
    fake_slurm.end_in(3600.0)
    job = slurm.SlurmJob("4242", None, None, 0, None, None, end_time=time.time() + 3600.0, preempt_time=time.time())
    follow = JobEnd(job, every=0.1, on_preempted=lambda view: False).start()
    try:
        later = fake_slurm.end_in(7200.0)
        deadline = time.monotonic() + 5
        while follow.end_time != later and time.monotonic() < deadline:
            time.sleep(0.05)
        assert follow.end_time == later and follow.preempted is None
    finally:
        follow.stop()


def ranks_preempted(tmp_path: Path, low: FakeSlurm, world: int, exit_wait: float = 0.0) -> list[float]:
    """``world`` gloo ranks (tests/faults/preempted_ranks.py), preempted once each trains; the
    time each process ended."""
    workspace = tmp_path / "run"
    port = free_port()
    log = tmp_path / "ranks.log"
    command = [sys.executable, str(ROOT / "tests" / "faults" / "preempted_ranks.py"), "--world", str(world)]
    command += ["--port", str(port), "--workspace", str(workspace), "--exit-wait", str(exit_wait)]
    with open(log, "ab") as out:
        procs = [
            subprocess.Popen([*command, "--rank", str(r)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            for r in range(world)
        ]
    try:
        deadline = time.monotonic() + 120
        while not all(named(events(workspace, r), "restore") for r in range(world)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        low.preempt(30)
        ended = []
        for p in procs:
            assert p.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
            ended.append(time.time())
        return ended
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow  # 18 s; in the fast tier rank 0's deadline reaches rank 1 the same way (tests/test_deadline.py)
@pytest.mark.distributed
def test_every_rank_records_rank_0s_preemption_as_the_reason_it_left(tmp_path: Path, low: FakeSlurm) -> None:
    """Three gloo ranks, each its own process; rank 0 alone reads the job and sees the
    ``PreemptTime``. The bit that says so travels in the step's agreement: every rank stops at
    one step and records ``reason="preemption"``, and the audit finds the trail consistent."""
    low.set_kill_wait(10)
    ranks_preempted(tmp_path, low, world=3)
    workspace = tmp_path / "run"
    agreed = [named(events(workspace, r), "signal_agreed") for r in range(3)]
    assert [[e["reason"] for e in a] for a in agreed] == [["preemption"]] * 3
    assert len({a[0]["agreed_step"] for a in agreed}) == 1
    report = audit.audit([workspace])
    assert report.consistent and report.ended_well, (report.problems, report.run_problems)


@pytest.mark.distributed
@pytest.mark.skipif(sys.platform != "linux", reason="torchrun and prctl: Linux")
def test_under_torchrun_rank_0s_notice_stops_its_agent_instead_of_a_restart(tmp_path: Path, low: FakeSlurm) -> None:
    """One torchrun worker (``--max-restarts 2``), ``requeue=False``: rank 0 sees the
    ``PreemptTime``, saves and exits 143. No signal reached its agent, so the worker stops it as it
    ends (``launcher_stop``); else torchrun would restart the worker into the preempted job, twice."""
    workspace, log = tmp_path / "run", tmp_path / "torchrun.log"
    launcher = Path(sys.executable).with_name("torchrun")
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--rdzv-backend", "static", "--master-port", str(free_port()), "--nproc-per-node", "1"]
    command += ["--max-restarts", "2", str(ROOT / "tests" / "faults" / "preempted_ranks.py")]
    command += ["--workspace", str(workspace), "--no-requeue"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    with open(log, "ab") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not named(events(workspace, 0), "restore"):
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        low.preempt(30)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    trail = events(workspace, 0)
    assert {e["attempt"] for e in trail} == {0}, log.read_text()[-3000:]  # no restart
    assert named(trail, "launcher_stop") and named(trail, "checkpoint_saved")
    assert named(trail, "exit")[-1]["reason"] == "preempted"
