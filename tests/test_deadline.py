"""The job's end (issue 34, items 3 and 4) in one process: the ``job_end_margin`` option, the job's
end read from SLURM, and the trainer leaving by the preemption's path before it. Here SLURM is a
stand-in ``scontrol`` on PATH (``tests.fake_slurm``) that answers with an end time the test sets; the real
cluster runs the same in tests/slurm/test_job_end.py."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fake_slurm import FakeSlurm
from tests.helpers import Slow, TinyTrainer, make_batches, parameters, read_events
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.checkpoint import io as checkpoint_io
from trainfsm.checkpoint.background import WriteTimes
from trainfsm.preemption import deadline, slurm
from trainfsm.preemption.deadline import AUTO_MARGIN_FLOOR, AUTO_MARGIN_SHARE, EXIT_SECONDS, Deadline
from trainfsm.preemption.signals import DEADLINE, SignalWatcher
from trainfsm.preemption.slurm import JobEnd, parse_end_time
from trainfsm.tools import audit


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    return FakeSlurm(tmp_path / "slurm", monkeypatch)


@pytest.fixture
def quick_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny CPU run exits in well under a second: plan half a second for it, not EXIT_SECONDS."""
    monkeypatch.setattr(deadline, "EXIT_SECONDS", 0.5)


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> float:
    """A file system on which each save's model.pt takes 2 s to become durable (its fsync); RESTORE's
    probe and room are not saves. Returns the seconds."""
    seconds = 2.0
    sync = checkpoint_io.DurableWriter.sync

    def slow_sync(self: Any) -> None:
        if self._path.name == "model.pt":
            time.sleep(seconds)
        sync(self)

    monkeypatch.setattr(checkpoint_io.DurableWriter, "sync", slow_sync)
    return seconds


def trainer(
    workspace: Path,
    steps: int,
    slow: float = 0.01,
    save_at: tuple[int, ...] = (),
    async_save: bool = False,
    **kwargs: Any,
) -> TinyTrainer:
    """``save_at``: steps that save besides the run's end (``keep_steps``)."""
    saves = CheckpointingHook(interval=1000, keep_steps=save_at, async_save=async_save)
    hooks = [saves, Slow(slow, kwargs.pop("at_step", None))]
    return TinyTrainer(max_steps=steps, workspace=workspace, hooks=hooks, **kwargs)


def job_ending(end: float, job_id: str = "7") -> slurm.SlurmJob:
    """A job with that end (epoch seconds), in a partition that never preempts."""
    return slurm.SlurmJob(job_id, None, None, 0, None, None, end_time=end)


# ---------------------------------------------------------------- the option
@pytest.mark.parametrize("value", ["auto", None, 0, 30, 2.5])
def test_job_end_margin_takes_auto_seconds_or_none(value: Any) -> None:
    expected = value if value in ("auto", None) else float(value)
    assert TinyTrainer(max_steps=1, job_end_margin=value).job_end_margin == expected


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("soon", TypeError),
        ("30", TypeError),
        (True, TypeError),
        ([30], TypeError),
        (-1, ValueError),
        (float("nan"), ValueError),
        (math.inf, ValueError),
    ],
)
def test_a_bad_job_end_margin_names_the_argument_and_what_it_takes(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        TinyTrainer(max_steps=1, job_end_margin=value)
    message = str(info.value)
    assert message.startswith("job_end_margin must be 'auto', a number of seconds >= 0 or None"), message
    assert repr(value) in message


# ---------------------------------------------------------------- pure parts
def test_the_deadline_adds_the_steps_a_save_the_exit_and_the_margin() -> None:
    end = JobEnd(job_ending(1000.0))  # not started: the end stays where it is
    one = Deadline(job_end=end, margin=2.0, steps=1)
    needed = 1 * 3.0 + 4.0 + EXIT_SECONDS + 2.0
    assert one.due(1000.0 - needed - 0.01, step=3.0, save=4.0) is None
    figures = one.due(1000.0 - needed + 0.01, step=3.0, save=4.0, save_measured=False)
    assert figures is not None and figures["needed"] == round(needed, 3)
    assert figures["left"] == pytest.approx(needed - 0.01)
    assert (figures["steps"], figures["margin"], figures["save_measured"]) == (1, 2.0, False)
    # Several ranks: the step-end all-reduce carries the signal one step later. Auto: the floor, or a quarter.
    assert Deadline.for_job(end, "auto", world=8) == Deadline(end, None, 2)
    small = Deadline(end, None, 1).due(999.0, step=1.0, save=1.0)
    assert small is not None and small["margin"] == AUTO_MARGIN_FLOOR
    large = Deadline(end, None, 2).due(999.0, step=100.0, save=200.0)
    assert large is not None and large["margin"] == AUTO_MARGIN_SHARE * (200.0 + 200.0 + EXIT_SECONDS)
    assert Deadline.for_job(None, "auto", 1) is None and Deadline.for_job(end, None, 1) is None
    end.end_time = None  # the limit lifted (TimeLimit=UNLIMITED) during the run: nothing is due
    assert one.due(2000.0, step=3.0, save=4.0) is None


def test_an_asynchronous_saves_write_counts_and_so_does_the_rest_of_one_in_flight() -> None:
    """EXIT waits for the write of the preemption's save, and its CHECKPOINT first waits for a write
    still in flight: the background writer's clock gives both (at the slowest write's rate)."""
    clock = WriteTimes()
    assert clock.unwritten(now=100.0) == (0.0, 0.0)  # nothing written yet
    clock.slowest = 3.0
    assert clock.unwritten(now=100.0) == (3.0, 0.0)
    clock.began = 99.0  # a write in flight for 1 s: 2 s to go, then the next save's 3 s
    assert clock.unwritten(now=100.0) == (3.0, 2.0)
    assert clock.unwritten(now=104.0) == (5.0, 0.0)  # slower than any before: the next may be as slow
    needed = 1 * 0.5 + 0.01 + 5.0 + EXIT_SECONDS + 1.0
    deadline = Deadline(JobEnd(job_ending(1000.0)), 1.0, 1)
    figures = deadline.due(1000.0 - needed + 0.01, step=0.5, save=0.01, write=5.0)
    assert figures is not None and figures["needed"] == round(needed, 3) and figures["write_seconds"] == 5.0
    assert deadline.due(1000.0 - needed - 0.01, step=0.5, save=0.01, write=5.0) is None


def test_the_end_time_is_read_from_scontrols_output() -> None:
    line = "JobId=7 JobState=RUNNING TimeLimit=00:01:00 StartTime=1795664753 EndTime=1795664813 Deadline=N/A"
    assert parse_end_time(line) == 1795664813.0
    local = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(1795664813))
    assert parse_end_time(line.replace("1795664813", local)) == 1795664813.0  # a SLURM without SLURM_TIME_FORMAT
    assert parse_end_time("JobId=7 TimeLimit=UNLIMITED EndTime=Unknown") is None
    assert parse_end_time("JobId=7 TimeLimit=00:01:00 EndTime=Unknown") is None
    assert parse_end_time("") is None


@pytest.mark.parametrize(
    ("limit", "end"),
    [("00:10:00", "1795664830"), ("UNLIMITED", "Unknown")],
    ids=["a time limit: EndTime moved to the grace end", "no time limit: EndTime stays Unknown"],
)
def test_a_preempted_jobs_deadline_is_the_grace_times_end_with_or_without_a_time_limit(limit: str, end: str) -> None:
    """SLURM 22.05 moves a preempted job's EndTime to PreemptTime + GraceTime, but a job without a
    time limit keeps ``EndTime=Unknown`` (measured on the project's cluster): its grace time ends
    ``GraceTime`` after ``PreemptTime`` all the same, and that plus ``KillWait`` is the deadline
    that applied (before, no deadline: the audit's preemption line had no margin)."""
    job = slurm.SlurmJob("7", None, None, 0, None, None, partition="low", preempt_mode="REQUEUE", grace_time=30.0)
    shown = f"JobId=7 JobState=RUNNING Restarts=0 TimeLimit={limit} EndTime={end} PreemptTime=1795664800 Partition=low"
    view = slurm.parse_job(shown, read_at=1795664808.0)
    assert slurm.grace_end(view, job) == 1795664830.0
    assert slurm.deadline_after(view, job, 1795664808.0, 10.0) == slurm.KillDeadline(
        "grace_time", 1795664830.0, 10.0, 1795664840.0
    )
    not_preempted = slurm.parse_job(shown.replace("PreemptTime=1795664800", "PreemptTime=None"), 1795664808.0)
    assert slurm.grace_end(not_preempted, job) is None


def test_the_jobs_end_is_read_again_on_a_thread_and_a_failed_read_keeps_the_last_one(
    fake_slurm: FakeSlurm,
) -> None:
    """``JobEnd`` reads ``scontrol`` every ``every`` seconds until ``stop``: a new end is taken; a
    controller that does not answer leaves the last one (the deadline stays armed); after ``stop``
    nothing is read and the thread is gone."""
    job_end = slurm.JobEnd(job_ending(fake_slurm.end_in(3600.0), "4242"), every=0.05).start()
    try:
        later = fake_slurm.end_in(7200.0)
        wait_until(lambda: job_end.end_time == later)
        fake_slurm.controller_down()
        failed = len(fake_slurm.calls())
        wait_until(lambda: len(fake_slurm.calls()) >= failed + 2)  # two reads failed meanwhile
        assert job_end.end_time == later
        fake_slurm.controller_down(False)
        earlier = fake_slurm.end_in(60.0)
        wait_until(lambda: job_end.end_time == earlier)
    finally:
        job_end.stop()
    assert not [t for t in threading.enumerate() if t.name == "trainfsm-slurm-job-end"]
    reads = len(fake_slurm.calls())
    time.sleep(0.2)
    assert len(fake_slurm.calls()) == reads


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


def test_a_deadline_pending_does_not_make_a_first_ctrl_c_a_second_one(tmp_path: Path) -> None:
    class Where:
        step, state = 3, "ACCUMULATE"

    watcher = SignalWatcher(Where())
    watcher.acting = frozenset({signal.SIGINT, signal.SIGTERM})
    assert watcher.raise_deadline(signal.SIGTERM) and watcher.pending == DEADLINE | signal.SIGTERM
    try:
        watcher._handle(signal.SIGINT, None)  # recorded; with a real signal pending it would raise
    except KeyboardInterrupt:
        pytest.fail("a first Ctrl-C while the deadline is pending was taken for a second one")
    assert [r.signum for r in watcher.received] == [signal.SIGINT]
    assert not watcher.raise_deadline(signal.SIGTERM)  # once
    watcher.pending = signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        watcher._handle(signal.SIGINT, None)


# ---------------------------------------------------------------- a real run under a fake SLURM
@pytest.mark.usefixtures("quick_exit")
@pytest.mark.parametrize(  # without the watchdog in the full tier: the fast tier's case has the two features meet
    "stall_timeout",
    ["auto", pytest.param(None, marks=pytest.mark.slow)],
    ids=["with_stall_watchdog", "stall_timeout_none"],
)
def test_the_trainer_leaves_by_the_preemption_path_before_the_jobs_end_and_resumes_exactly(
    tmp_path: Path, fake_slurm: FakeSlurm, stall_timeout: Any
) -> None:
    """SLURM says the job ends 5-6 s from now; the run needs far longer. Before the end, rank 0's
    watchdog thread (started for the deadline alone when ``stall_timeout=None``) raises the pending
    signal: the step ends, the checkpoint hook saves, the job is requeued, and the process exits 143
    (SIGTERM, the policy's first signal), all before the end. Trail: ``run_start.slurm.end_time``,
    ``deadline``, ``signal_agreed`` (reason deadline), ``job_end``, ``requeue``, ``exit``. The next
    attempt resumes and ends with an uninterrupted run's parameters."""
    workspace = tmp_path / "run"
    end = fake_slurm.end_in(9.0)  # BUILD takes seconds on a busy machine: leave time to measure steps
    first = trainer(workspace, steps=1000, job_end_margin=0.25, stall_timeout=stall_timeout)
    with pytest.raises(SystemExit) as info:
        first.train()
    left_at_exit = end - time.time()
    events = read_events(workspace)
    assert info.value.code == 128 + signal.SIGTERM
    assert 0 < left_at_exit < 9.0, [(e["event"], e["step"], round(end - e["ts"], 3)) for e in events]
    start = events[0]
    assert start["event"] == "run_start" and start["slurm"]["end_time"] == end
    names = [e["event"] for e in events]
    # No signal came before the job's end did; SLURM's SIGTERM after the requeue is in the trail, before exit.
    [term] = [e for e in events if e["event"] == "signal_received"]
    assert (term["signal"], term["at_state"]) == ("SIGTERM", "EXIT")
    assert names.index("requeue") < names.index("signal_received") < names.index("exit")
    [made] = [e for e in events if e["event"] == "deadline"]
    [agreed] = [e for e in events if e["event"] == "signal_agreed"]
    assert names.index("deadline") + 1 == names.index("signal_agreed")
    assert (agreed["signal"], agreed["reason"], agreed["agreed_step"]) == ("SIGTERM", "deadline", made["step"])
    # left < needed fires it; to the millisecond the event gives, the two can be equal
    assert made["end_time"] == end and 0 < made["left"] <= made["needed"] and made["margin"] == 0.25
    assert made["decided_at"] <= agreed["step_ended_at"] <= agreed["ts"]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert [e["saved_step"] for e in saved] == [agreed["agreed_step"]] and saved[0]["ts"] < end
    [job_end] = [e for e in events if e["event"] == "job_end"]
    assert (job_end["end_time"], job_end["after"], job_end["state"]) == (end, "deadline", "EXIT")
    assert (job_end["applied"], job_end["kill_start"], job_end["job_state"]) == ("time_limit", end, "RUNNING")
    assert names.index("job_end") < names.index("requeue") < names.index("exit")
    assert fake_slurm.requeued() == ["4242"]
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["code"]) == ("exit", "preempted", 143)
    assert events[-1]["ts"] < end
    # Rank 0 asked SLURM with SLURM_TIME_FORMAT=%s: at the start, and after the deadline (before the requeue).
    assert [c for c in fake_slurm.calls() if "show job" in c] == ["%s|show job -o 4242"] * 2

    report = audit.audit([workspace])
    assert report.consistent and report.ended_well, (report.problems, report.run_problems)
    timing = report.attempts[0].as_dict()["preemption"]
    assert (timing["cause"], timing["signal"], timing["agreed_step"], timing["at"]) == (
        "deadline",
        "SIGTERM",
        agreed["agreed_step"],
        made["decided_at"],
    )
    assert 0 <= timing["step_finished"] <= timing["agreed"] <= timing["durable"] <= timing["exit"]
    assert timing["job_end"] == end and timing["job_end_read"] == "signal" and timing["margin"] > 0
    text = audit.render(report)  # no signal came before the end: the one received is SLURM's after the requeue
    step = agreed["agreed_step"]
    assert (
        f"  signals: SIGTERM on rank 0 at step {step} (EXIT); the job's end near: agreed at step {step} to leave "
        "as if by SIGTERM" in text
    )

    fake_slurm.end_in(3600.0)
    second = trainer(workspace, steps=1000, slow=0.0, job_end_margin=0.25, stall_timeout=stall_timeout)
    second.train()
    again = [e for e in read_events(workspace) if e["attempt"] == 1]
    assert not [e for e in again if e["event"] in ("deadline", "signal_agreed", "job_end")]
    assert (again[-1]["event"], again[-1]["reason"]) == ("exit", "completed")
    straight = trainer(tmp_path / "straight", steps=1000, slow=0.0, job_end_margin=None)
    straight.train()
    assert all(torch.equal(a, b) for a, b in zip(parameters(second), parameters(straight), strict=True))


@pytest.mark.usefixtures("quick_exit")
@pytest.mark.parametrize("async_save", [False, True], ids=["synchronous", "asynchronous"])
def test_with_slow_writes_the_last_checkpoint_is_durable_and_the_job_requeued_before_its_end(
    tmp_path: Path, fake_slurm: FakeSlurm, slow_writes: float, async_save: bool
) -> None:
    """Each save's write takes 2 s; a save at step 2 measures it. With ``async_save`` the
    CHECKPOINT state only stages the state (milliseconds) and EXIT waits for the write: the deadline
    counts the write as the background writer measured it (``write_seconds``), so the preemption's
    checkpoint is durable, the job requeued and the process gone before the job's end, as with
    synchronous saves."""
    workspace = tmp_path / "run"
    end = fake_slurm.end_in(10.0)
    run = trainer(workspace, steps=100_000, save_at=(2,), async_save=async_save, job_end_margin=0.25)
    with pytest.raises(SystemExit) as info:
        run.train()
    events = read_events(workspace)
    timeline = [(e["event"], e["step"], round(end - e["ts"], 3)) for e in events if e["event"] != "transition"]
    assert info.value.code == 128 + signal.SIGTERM
    [agreed] = [e for e in events if e["event"] == "signal_agreed"]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert saved[0]["saved_step"] == 2 and saved[-1]["saved_step"] == agreed["agreed_step"]
    [requeue] = [e for e in events if e["event"] == "requeue"]
    assert saved[-1]["ts"] < requeue["ts"] < events[-1]["ts"] < end, timeline
    assert fake_slurm.requeued() == ["4242"] and events[-1]["event"] == "exit"
    [made] = [e for e in events if e["event"] == "deadline"]
    assert made["save_measured"] and made["save_seconds"] + made["write_seconds"] >= slow_writes
    assert made["write_seconds"] >= slow_writes if async_save else made["write_seconds"] == 0.0


@pytest.fixture
def reread_often(monkeypatch: pytest.MonkeyPatch) -> float:
    """Rank 0 reads the job's end again every 0.25 s (a minute in a real run): seconds for a test."""
    monkeypatch.setattr(slurm, "REREAD_SECONDS", 0.25)
    return 0.25


class StopAt(BaseHook):
    """Ends the run (reason ``stopped``) once ``when()`` is a time in the past."""

    def __init__(self, when: Any) -> None:
        self.when = when

    def wants_stop(self, trainer: BaseTrainer) -> bool:
        when = self.when()
        return when is not None and time.time() > when


@pytest.mark.usefixtures("quick_exit", "reread_often")
def test_a_time_limit_shortened_during_the_run_moves_the_deadline_earlier(
    tmp_path: Path, fake_slurm: FakeSlurm
) -> None:
    """The job ends in an hour; at step 3 ``scontrol update TimeLimit=`` brings its end to 4 s from
    then. Rank 0 reads the end again (off the step's path) and leaves by the deadline before the new
    end: saved, requeued, exit 143. Without the re-read the run would train on past it (it stops 2 s
    after it by itself)."""
    fake_slurm.end_in(3600.0)
    moved: list[float] = []
    hooks = [
        CheckpointingHook(interval=1000),
        Slow(0.01, at_step={3: lambda: moved.append(fake_slurm.end_in(4.0))}),
        StopAt(lambda: moved[0] + 2.0 if moved else None),
    ]
    run = TinyTrainer(max_steps=100_000, workspace=tmp_path, hooks=hooks, job_end_margin=0.25)
    with pytest.raises(SystemExit) as info:
        run.train()
    assert info.value.code == 128 + signal.SIGTERM
    events = read_events(tmp_path)
    [made] = [e for e in events if e["event"] == "deadline"]
    assert made["end_time"] == moved[0] and made["step"] > 3
    assert events[-1]["ts"] < moved[0] and fake_slurm.requeued() == ["4242"]
    reads = [c for c in fake_slurm.calls() if c == "%s|show job -o 4242"]
    assert 3 <= len(reads) < made["step"]  # the start, re-reads, the preemption's; never one per step


@pytest.mark.usefixtures("quick_exit", "reread_often")
def test_a_time_limit_lengthened_during_the_run_moves_the_deadline_later(tmp_path: Path, fake_slurm: FakeSlurm) -> None:
    """The job ends 6 s after the start; at step 1 its limit is raised by an hour. The run trains on
    past the first end (it stops 1 s after it by itself) and never takes the deadline's way out."""
    first = fake_slurm.end_in(6.0)
    hooks = [
        CheckpointingHook(interval=1000),
        Slow(0.01, at_step={1: lambda: fake_slurm.end_in(3600.0)}),
        StopAt(lambda: first + 1.0),
    ]
    TinyTrainer(max_steps=100_000, workspace=tmp_path, hooks=hooks, job_end_margin=0.25).train()
    events = read_events(tmp_path)
    assert not [e for e in events if e["event"] in ("deadline", "signal_agreed", "requeue")]
    assert (events[-1]["event"], events[-1]["reason"]) == ("exit", "stopped") and events[-1]["ts"] > first


@pytest.mark.usefixtures("quick_exit")
def test_job_end_margin_none_leaves_the_end_to_slurm(tmp_path: Path, fake_slurm: FakeSlurm) -> None:
    """The guard of the test above: with the deadline off, the same run goes past the job's end."""
    end = fake_slurm.end_in(1.0)
    trainer(tmp_path, steps=150, job_end_margin=None).train()
    events = read_events(tmp_path)
    assert events[-1]["ts"] > end and (events[-1]["reason"], events[-1]["code"]) == ("completed", 0)
    assert not [e for e in events if e["event"] in ("deadline", "signal_agreed", "job_end", "requeue")]


def test_the_job_end_read_after_a_signal_is_the_one_audit_measures_the_margin_against(
    tmp_path: Path, fake_slurm: FakeSlurm
) -> None:
    """A preemption moves the job's end (SLURM's grace time): rank 0 reads it again after the signal.
    Here the end is an hour away at the start and at the signal itself after it: the checkpoint becomes
    durable after it, and the audit says so in a note (not a run problem: the save is complete)."""
    fake_slurm.end_in(3600.0)
    moved: list[float] = []

    def preempt() -> None:
        moved.append(fake_slurm.end_at(time.time()))
        os.kill(os.getpid(), signal.SIGUSR1)

    with pytest.raises(SystemExit) as info:
        trainer(tmp_path, steps=20, at_step={3: preempt}).train()
    assert info.value.code == 128 + signal.SIGUSR1
    events = read_events(tmp_path)
    [job_end] = [e for e in events if e["event"] == "job_end"]
    assert job_end["after"] == "signal" and job_end["end_time"] == moved[0]

    report = audit.audit([tmp_path])
    assert report.consistent and report.ended_well
    timing = report.attempts[0].as_dict()["preemption"]
    assert timing["job_end_read"] == "signal" and timing["save_after_end"] and timing["margin"] < 0
    [note] = [n.message for n in report.notes if "job's end" in n.message]
    assert note.startswith("attempt 0: the SIGUSR1 preemption's checkpoint (step 4) became durable ")
    assert "--signal=USR1@" in note and "docs/guides/preemption.md#how-much-lead-time" in note


def test_outside_slurm_nothing_is_read_and_no_deadline_is_armed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No SLURM_JOB_ID: no scontrol call (one is on PATH), no end time, no thread with the stall
    watchdog off, and a signal's preemption has no job_end."""
    fake = FakeSlurm(tmp_path / "slurm", monkeypatch)
    fake.end_in(0.0)  # were it read, the deadline would be due at once
    monkeypatch.delenv("SLURM_JOB_ID")
    threads: list[bool] = []

    class Look(BaseHook):
        def on_after_step(self, trainer: BaseTrainer) -> None:
            threads.append(any(t.name == "trainfsm-watchdog" for t in threading.enumerate()))
            if trainer.step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    run = TinyTrainer(
        max_steps=6, workspace=tmp_path / "run", hooks=[CheckpointingHook(interval=100), Look()], stall_timeout=None
    )
    with pytest.raises(SystemExit):
        run.train()
    events = read_events(tmp_path / "run")
    assert events[0]["slurm"] is None and run.slurm is None and threads == [False] * 4
    assert not [e for e in events if e["event"] in ("deadline", "job_end", "requeue")]
    [agreed] = [e for e in events if e["event"] == "signal_agreed"]
    assert agreed["reason"] == "signal" and agreed["step_ended_at"] <= agreed["ts"]
    assert fake.calls() == []


@pytest.mark.distributed
@pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux")
def test_with_two_ranks_rank_0s_deadline_reaches_rank_1_through_the_step_agreement(
    tmp_path: Path, fake_slurm: FakeSlurm
) -> None:
    """Two gloo ranks in a SLURM job whose end comes before their work is done; no signal. Only
    rank 0 asks SLURM (once at the start, once after the deadline) and decides; the step-end
    all-reduce carries the pending "signal" with its deadline bit, so both ranks agree on the same
    step with reason ``deadline``, rank 0 saves and requeues, both exit 138."""
    from tests.faults.two_ranks import events, scenario

    end = fake_slurm.end_in(14.0)
    result = scenario(tmp_path / "run", timeout=60, slurm_env={"SLURM_JOB_ID": "4242"})
    assert not result["hung"] and result["codes"] == {0: 138, 1: 138}, result["stderr"]
    trails = {rank: events(tmp_path / "run", rank) for rank in (0, 1)}
    assert trails[0][0]["slurm"]["end_time"] == end and trails[1][0]["slurm"]["end_time"] is None
    [made] = [e for e in trails[0] if e["event"] == "deadline"]
    assert made["steps"] == 2 and not [e for e in trails[1] if e["event"] == "deadline"]
    agreed = {rank: [e for e in trails[rank] if e["event"] == "signal_agreed"] for rank in (0, 1)}
    assert [(e["agreed_step"], e["reason"], e["signal"]) for e in agreed[0]] == [(made["step"], "deadline", "SIGUSR1")]
    assert [(e["agreed_step"], e["reason"]) for e in agreed[1]] == [(made["step"], "deadline")]
    assert agreed[1][0]["step_ended_at"] is None  # nothing was pending on rank 1 itself
    assert [e["saved_step"] for e in trails[0] if e["event"] == "checkpoint_saved"] == [made["step"]]
    assert [c for c in fake_slurm.calls() if "show job" in c] == ["%s|show job -o 4242"] * 2
    assert fake_slurm.requeued() == ["4242"]
    assert max(trails[rank][-1]["ts"] for rank in (0, 1)) < end
    report = audit.audit([tmp_path / "run"])
    assert report.consistent and report.ended_well, (report.problems, report.run_problems)
    timing = report.attempts[0].as_dict()["preemption"]
    assert timing["cause"] == "deadline" and timing["margin"] > 0


class SkipsOneOnLoad:
    """``make_batches(16)`` per epoch, with a position of its own that ``load_state_dict`` sets one
    micro-batch too far. Saved at an epoch's end, the skip carries into the next epoch's first batch
    (the deadline's step is the machine's timing: CI once agreed on step 320, 20 epochs exactly)."""

    def __init__(self) -> None:
        self.batches, self.position, self.carry = make_batches(16), 0, 0

    def __iter__(self) -> Any:
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position, self.carry = self.carry, 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"] + 1
        if self.position > len(self.batches):  # past this epoch: the next one starts a batch late
            self.carry = self.position - len(self.batches)


@pytest.mark.slow  # ~12 s: the job's end is 9 s away
def test_a_loader_that_skips_a_micro_batch_after_a_deadline_save_is_named_by_the_audit(
    tmp_path: Path, fake_slurm: FakeSlurm
) -> None:
    """The deadline's save is one the run leaves by: the micro-batch a resume must draw first is
    drawn at exit and fingerprinted, so a loader that resumes one micro-batch too far is caught."""
    workspace = tmp_path / "run"
    fake_slurm.end_in(9.0)
    first = trainer(workspace, steps=1000, job_end_margin=0.25, stall_timeout=None, batches=SkipsOneOnLoad())
    with pytest.raises(SystemExit) as info:
        first.train()
    assert info.value.code == 128 + signal.SIGTERM
    [agreed] = [e for e in read_events(workspace) if e["event"] == "signal_agreed"]
    step = agreed["agreed_step"]
    fake_slurm.end_in(3600.0)
    second = trainer(workspace, steps=step + 2, slow=0.0, job_end_margin=0.25, batches=SkipsOneOnLoad())
    second.train()
    [problem] = [p.message for p in audit.audit([workspace]).run_problems if p.kind == "ledger"]
    # Mid-epoch: "the first micro-batch after resuming from checkpoint S is not the one attempt 0 drew after
    # saving it"; before an epoch's last: "after resuming from checkpoint S the data loader ended epoch E at once".
    assert problem.startswith("rank 0, attempt 1: ") and f"resuming from checkpoint {step} " in problem, problem
    assert problem.endswith("the loader did not resume where it said it did") or problem.endswith(
        "the data loader did not resume where it said it did"
    ), problem
