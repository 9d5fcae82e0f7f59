"""The stall exit's edges (issue 46): ``stall_action="exit"`` ends the process even when the stall is
in the I/O it reports on, its write-out of the trainer thread's records neither duplicates nor
loses a line, and a stall that recurs at the same step and state stops the requeue loop."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.fake_slurm import FakeSlurm
from tests.helpers import TinyTrainer, make_batches, read_events
from trainfsm import BaseHook, BaseTrainer, watchdog
from trainfsm.machine import ROUTINE_END, ROUTINE_START, STALL_EXIT_CODE
from trainfsm.tools import trace
from trainfsm.trail.writer import EventLog
from trainfsm.watchdog import AutoBudgets, Watchdog

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def warm() -> None:
    """What a first optimizer step imports, before budgets under a second time BUILD."""
    parameter = torch.zeros(1, requires_grad=True)
    parameter.sum().backward()
    torch.optim.SGD([parameter], lr=0.1).step()


def stalls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "stall"]


# ---------------------------------------------------------------- a stall in the I/O it reports on
STDERR_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import torch
from tests.helpers import TinyTrainer

parameter = torch.zeros(1, requires_grad=True)  # what a first step imports, before BUILD's half second
parameter.sum().backward()
torch.optim.SGD([parameter], lr=0.1).step()

class Loud(TinyTrainer):
    def forward(self, input):
        if self.step == 3:
            sys.stderr.write("x" * (1 << 20))  # blocks for good: nobody reads the pipe
            sys.stderr.flush()
        return super().forward(input)

Loud(max_steps=6, workspace=sys.argv[1], stall_timeout=0.5, stall_action="exit").train()
"""


def test_with_exit_a_main_thread_stuck_on_a_full_stderr_pipe_still_ends_with_75_and_its_stall_in_the_trail(
    tmp_path: Path,
) -> None:
    """The watchdog's console line goes to the stderr the main thread holds: it must not wait on it."""
    script = tmp_path / "loud.py"
    script.write_text(STDERR_SCRIPT.format(root=str(ROOT)))
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ws")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,  # read by nobody: full after 64 KiB, as an srun output pipe that stalls
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        code = process.wait(timeout=40)  # the exit's hard deadline (60 s) must not be what ends it
    except subprocess.TimeoutExpired:
        code = None
    finally:
        process.kill()
        process.wait()
        assert process.stderr is not None
        process.stderr.close()
    seconds = time.monotonic() - started
    assert code == STALL_EXIT_CODE, f"still alive after {seconds:.0f} s" if code is None else code
    events = read_events(tmp_path / "ws")
    (stall,) = stalls(events)
    assert (stall["state"], stall["step"], stall["action"]) == ("ACCUMULATE", 3, "exit")
    assert stall["stack"][-1].endswith("Loud.forward")
    assert events[-1]["event"] == "exit" and (events[-1]["reason"], events[-1]["code"]) == ("stalled", 75)


class Mark:
    moves = 0
    evaluating = False


def test_the_stall_exit_ends_the_process_at_its_deadline_even_when_the_requeue_never_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watchdog, "EXIT_DEADLINE_SECONDS", 1.0)
    never = threading.Event()
    exited: list[tuple[int, float]] = []
    ended = threading.Event()

    def exit(code: int) -> None:
        exited.append((code, time.monotonic()))
        ended.set()

    log = event_log(tmp_path / "events.jsonl", SimpleNamespace(step=3))
    trainer = SimpleNamespace(state="ACCUMULATE", step=3, exit_reason=None, exit_code=None)
    dog = Watchdog(
        timeout=0.25,
        action="exit",
        progress=Mark(),
        trainer=trainer,
        event_log=log,
        micro=int,
        requeue=lambda record, refused: never.wait(),  # scontrol hung past its own timeout
        exit=exit,
    )
    started = time.monotonic()
    dog.start()
    try:
        assert ended.wait(10)
        ((code, when),) = exited
        lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    finally:
        never.set()  # the test's watchdog goes on (its exit returned): let it finish, then stop it
        dog.stop()
    assert code == STALL_EXIT_CODE
    assert 0.25 + 1.0 <= when - started < 0.25 + 1.0 + 1.0  # the budget, then the exit's deadline
    assert [e["event"] for e in lines] == ["stall"]  # written before the requeue that hung


# ---------------------------------------------------------------- the exit's write-out
def event_log(path: Path, owner: Any) -> EventLog:
    return EventLog(
        path=path,
        console=logging.getLogger("trainfsm.test"),
        rank=0,
        run_id="r",
        attempt=0,
        progress=lambda: (owner.step, "STEP"),
        owner=owner,
    )


def steps_in(path: Path) -> list[int]:
    """The steps whose end (``stepped``) the file holds, once per line that holds it."""
    found: list[int] = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "steps":
            found.extend(range(event["first"], event["step"] + 1))
        elif event["event"] == "transition" and event["trigger"] == "stepped":
            found.append(event["step"])
    return found


def test_the_exit_write_out_neither_duplicates_nor_loses_a_line_while_the_trainer_thread_is_inside_a_write(
    tmp_path: Path,
) -> None:
    """A slow trainer thread (not stuck) is in the middle of a write of its own (steps 1-5's run
    queued, the run not yet closed) when the watchdog takes the trail over: the write-out waits
    for it, and every step recorded before the handover is in the file exactly once."""
    paused, resume = threading.Event(), threading.Event()

    class Slow(list[Any]):
        """The log's queue: the trainer's thread pauses just after it queues a run's record."""

        def append(self, item: Any) -> None:
            super().append(item)
            if isinstance(item, bytes) and threading.current_thread() is thread and not paused.is_set():
                paused.set()
                resume.wait(0.5)  # slow, not stuck: well under the write-out's wait on the lock

    owner = SimpleNamespace(step=0)
    log = event_log(tmp_path / "events.jsonl", owner)
    log._pending = Slow()
    start, end = log.transition_recorder(*ROUTINE_START), log.transition_recorder(*ROUTINE_END)
    save = log.transition_recorder("save", "STEP", "CHECKPOINT")

    def trainer() -> None:
        for _ in range(5):
            owner.step += 1
            start()
            end()  # folded into the open run
        save()  # not routine: the run is queued first, and the thread pauses there

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    assert paused.wait(5)
    log.write_out_before_exit(watchdog.EXIT_WRITE_SECONDS / 2)  # as the watchdog's exit does
    resume.set()  # the old writer's write-out did not wait: the thread goes on after it
    written = steps_in(tmp_path / "events.jsonl")  # what the file holds as the process ends
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    log.hand_back()  # only a test gets the trail back: the watchdog's process ends instead
    thread.join(5)
    log.close()
    assert written == [1, 2, 3, 4, 5]
    assert [(e["event"], e["step"], e.get("trigger")) for e in lines] == [("steps", 5, None), ("transition", 5, "save")]


# ---------------------------------------------------------------- a stall that recurs
EVALUATION_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
import torch
from tests.helpers import TinyTrainer
from trainfsm import BaseHook, CheckpointingHook

parameter = torch.zeros(1, requires_grad=True)  # what a first step imports, before BUILD's budget
parameter.sum().backward()
torch.optim.SGD([parameter], lr=0.1).step()

class LongEvaluation(BaseHook):
    def on_evaluate(self, trainer):
        if trainer.step == 6:
            time.sleep(60)  # longer than its budget, at a checkpoint step: every attempt again

TinyTrainer(
    max_steps=9, workspace=sys.argv[1], stall_timeout=2, stall_action="exit",
    hooks=[LongEvaluation(), CheckpointingHook(interval=3)],
).train()
"""


def test_a_stall_exit_at_the_same_step_and_state_as_the_attempt_before_is_not_requeued_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SLURM batch job (the stand-in ``scontrol``) started again for as long as it is requeued: an
    evaluation longer than its budget at the checkpoint step 6 ends attempt 0 with 75 and a
    requeue; attempt 1 resumes from step 3 and stalls in the same place, so it is not requeued,
    and the trail and ``trainfsm trace`` say why."""
    fake = FakeSlurm(tmp_path / "slurm", monkeypatch)
    fake.end_in(3600)
    script = tmp_path / "evaluation.py"
    script.write_text(EVALUATION_SCRIPT.format(root=str(ROOT)))
    workspace = tmp_path / "ws"
    codes = []
    for restarts in range(4):  # SLURM_RESTART_COUNT, as SLURM counts the requeues
        requeued = len(fake.requeued())
        done = subprocess.run(
            [sys.executable, str(script), str(workspace)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", "SLURM_RESTART_COUNT": str(restarts)},
        )
        codes.append(done.returncode)
        if len(fake.requeued()) == requeued:  # not requeued: SLURM ends the job here
            break
    assert codes == [STALL_EXIT_CODE, STALL_EXIT_CODE], codes
    events = read_events(workspace)
    exits = [(e["attempt"], e["step"], e["state"], e["reason"]) for e in events if e["event"] == "exit"]
    assert exits == [(0, 6, "ACCUMULATE", "stalled"), (1, 6, "ACCUMULATE", "stalled")]
    requeues = [(e["attempt"], e["ok"]) for e in events if e["event"] == "requeue"]
    assert requeues == [(0, True), (1, False)]
    (refused,) = [e for e in events if e["event"] == "requeue" and not e["ok"]]
    assert refused["message"] == (
        "not requeued: the same stall (ACCUMULATE at step 6) ended attempt 0; "
        "a requeue would resume from the same checkpoint and stall there again"
    )
    assert [e.get("repeats") for e in events if e["event"] == "exit"] == [None, 0]
    text = trace.render(trace.trace([workspace]))
    assert (
        "  repeated: rank 0 stalled in ACCUMULATE running step 6 as attempt 0 did: not requeued "
        "(the next attempt would resume from the same checkpoint and stall there again)"
    ) in text


# ---------------------------------------------------------------- evaluations' own budgets
# Floors far below every slow part, so the learned budgets carry the tests (as in test_watchdog.py).
SMALL = AutoBudgets(
    build=5.0, restore=5.0, first_step=5.0, step_floor=0.05, step_multiple=10.0, checkpoint_floor=0.05, exit=5.0
)


class Paced(TinyTrainer):
    """Steps of about 20 ms."""

    def forward(self, input: Any) -> Any:
        time.sleep(0.02)
        return super().forward(input)


class Evaluations(BaseHook):
    """An evaluation of ``seconds[step]`` at those steps."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds

    def on_evaluate(self, trainer: BaseTrainer) -> None:
        time.sleep(self.seconds.get(trainer.step, 0.0))


def test_a_first_evaluation_far_longer_than_a_step_is_no_stall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its budget is the first evaluation's of a launch (10 minutes), not the steps' (here ~0.3 s)."""
    monkeypatch.setattr(watchdog, "AUTO", SMALL)
    trainer = Paced(max_steps=32, batches=make_batches(64), workspace=tmp_path, hooks=[Evaluations({30: 3.0})])
    trainer.train()
    assert stalls(read_events(tmp_path)) == []


def test_a_later_evaluation_far_longer_than_the_ones_before_is_reported_in_the_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Learned like the steps': ``evaluation_multiple`` (2 here) x the slowest evaluation so far."""
    monkeypatch.setattr(watchdog, "AUTO", replace(SMALL, evaluation_multiple=2.0))
    hooks = [Evaluations({20: 0.5, 30: 3.0})]
    Paced(max_steps=32, batches=make_batches(64), workspace=tmp_path, hooks=hooks).train()
    stall, *_ = stalls(read_events(tmp_path))
    assert (stall["state"], stall["step"], stall["hook"]) == ("ACCUMULATE", 30, "Evaluations.on_evaluate")
    assert 2 * 0.5 <= stall["budget"] <= 2 * (0.5 + 2 / watchdog.TICKS_PER_SECOND)  # seen to a tick each end


def test_evaluation_budgets_follow_the_documented_rules() -> None:
    dog = Watchdog(
        timeout="auto",
        action="record",
        progress=Mark(),
        trainer=None,
        event_log=None,  # type: ignore[arg-type]
        micro=int,
        requeue=lambda record, refused: None,
    )
    assert dog.budget("ACCUMULATE", evaluating=True) == 600.0  # nothing measured: the first of a launch
    dog._steps.extend([0.5, 30.0])
    assert dog.budget("ACCUMULATE", evaluating=True) == 600.0  # still the first evaluation's
    dog._evaluations.append(20.0)
    assert dog.budget("ACCUMULATE", evaluating=True) == 300.0  # the step's: 10 x 20 s is less than 10 x 30 s
    dog._evaluations.append(45.0)
    assert dog.budget("ACCUMULATE", evaluating=True) == 450.0  # 10 x the slowest evaluation
    assert dog.budget("ACCUMULATE") == 300.0  # a step's own budget is unchanged
