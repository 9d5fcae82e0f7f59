"""The stall watchdog in one process (issue 33): a rank that stops moving writes ``stall`` events that
say where it is and what it is in, ``stall_cleared`` when it moves again; ``stall_action="exit"``
ends the process with 75; budgets that do not cry wolf. Several ranks: test_watchdog_distributed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer, make_batches, read_events
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook, watchdog
from trainfsm.checkpoint import io as checkpoint_io
from trainfsm.checkpoint.background import WriteTimes
from trainfsm.machine import STALL_EXIT_CODE
from trainfsm.tools import audit, trace
from trainfsm.watchdog import AutoBudgets, Watchdog

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


@pytest.fixture(autouse=True, scope="module")
def warm() -> None:
    """Import what a first optimizer step imports (torch's compiler modules, seconds on a busy
    machine) before the tests time BUILD with budgets under a second."""
    parameter = torch.zeros(1, requires_grad=True)
    parameter.sum().backward()
    torch.optim.SGD([parameter], lr=0.1).step()


def stalls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "stall"]


def line_of(text: str) -> int:
    """The line of this file that holds ``text`` (a stall's stack must point at it)."""
    (number,) = [n for n, line in enumerate(HERE.read_text().splitlines(), 1) if text in line and "line_of" not in line]
    return number


class SleepyTrainer(TinyTrainer):
    """TinyTrainer whose forward sleeps ``seconds`` at ``step`` (once)."""

    def __init__(self, *, sleep_at: int = -1, seconds: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sleep_at, self.seconds = sleep_at, seconds

    def forward(self, input: Any) -> Any:
        if self.step == self.sleep_at:
            self.sleep_at = -1
            time.sleep(self.seconds)  # the forward that stalls
        return super().forward(input)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf")])
def test_a_budget_that_is_not_a_positive_number_is_refused_naming_the_argument(value: float) -> None:
    with pytest.raises(ValueError, match=r"stall_timeout must be 'auto', a positive number of seconds or None"):
        TinyTrainer(max_steps=1, stall_timeout=value)


@pytest.mark.parametrize("value", ["soon", True, [3]])
def test_a_budget_of_another_type_is_refused_naming_the_allowed_values(value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=r"stall_timeout must be 'auto'"):
        TinyTrainer(max_steps=1, stall_timeout=value)


@pytest.mark.parametrize("value", ["kill", "", None, 1])
def test_an_unknown_action_is_refused_naming_record_and_exit(value: Any) -> None:
    with pytest.raises(ValueError, match=r"stall_action must be one of 'record', 'exit'"):
        TinyTrainer(max_steps=1, stall_action=value)


def test_the_defaults_are_auto_and_record() -> None:
    trainer = TinyTrainer(max_steps=1)
    assert (trainer.stall_timeout, trainer.stall_action) == ("auto", "record")
    assert TinyTrainer(max_steps=1, stall_timeout=2).stall_timeout == 2.0


# ---------------------------------------------------------------- what a stall says
def test_a_forward_that_sleeps_past_its_budget_is_recorded_with_the_users_file_and_line(tmp_path: Path) -> None:
    trainer = SleepyTrainer(max_steps=6, workspace=tmp_path, stall_timeout=0.5, sleep_at=3, seconds=1.4)
    trainer.train()
    events = read_events(tmp_path)
    first, second = stalls(events)  # at the budget and at twice it; the third would be at 2 s
    assert (first["state"], first["step"], first["micro"], first["report"]) == ("ACCUMULATE", 3, 0, 1)
    assert first["doing"] == "forward" and first["collective"] is None and first["hook"] is None
    assert first["budget"] == 0.5 and 0.5 <= first["seconds"] < 0.5 + 0.3
    assert second["report"] == 2 and 1.0 <= second["seconds"] < 1.0 + 0.3
    assert first["stack"][-1] == f"{HERE}:{line_of('# the forward that stalls')} SleepyTrainer.forward"
    assert first["by"] == "watchdog"
    (cleared,) = [e for e in events if e["event"] == "stall_cleared"]
    assert (cleared["stalled_state"], cleared["stalled_step"], cleared["reports"]) == ("ACCUMULATE", 3, 2)
    assert 1.4 - 0.3 <= cleared["seconds"] < 1.4 + 0.3  # seen to a look (a quarter second) each end
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "completed"


def test_a_trail_with_stalls_that_cleared_is_consistent_and_the_run_ended_well(tmp_path: Path) -> None:
    SleepyTrainer(max_steps=6, workspace=tmp_path, stall_timeout=0.3, sleep_at=2, seconds=0.8).train()
    report = audit.audit([tmp_path])
    assert report.problems == [] and report.run_problems == []
    (rank,) = report.attempts[0].ranks
    assert [(s["state"], s["step"], s["cleared"] is not None) for s in rank.stalls] == [("ACCUMULATE", 2, True)]


class BlockingLoader:
    """A data loader whose ``__next__`` blocks once, at batch ``at``."""

    def __init__(self, at: int, seconds: float) -> None:
        self.batches, self.at, self.seconds = make_batches(16), at, seconds

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.batches):
            if index == self.at:
                time.sleep(self.seconds)  # a worker that deadlocked, a stalled file system
            yield batch


def test_a_data_loader_whose_next_blocks_is_named_as_the_data_loader(tmp_path: Path) -> None:
    trainer = TinyTrainer(max_steps=6, workspace=tmp_path, stall_timeout=0.5, batches=BlockingLoader(3, 0.9))
    trainer.train()
    (stall,) = stalls(read_events(tmp_path))
    assert (stall["state"], stall["step"]) == ("ACCUMULATE", 4)  # the fourth batch is step 4's
    assert stall["doing"] == "the data loader's next()"
    assert stall["stack"][-1].endswith(f"{line_of('# a worker that deadlocked')} BlockingLoader.__iter__")


class SlowAfterStep(BaseHook):
    def __init__(self, at: int, seconds: float) -> None:
        self.at, self.seconds = at, seconds

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.at:
            time.sleep(self.seconds)


def test_a_hook_method_that_blocks_is_named_by_its_class_and_method(tmp_path: Path) -> None:
    trainer = TinyTrainer(max_steps=5, workspace=tmp_path, stall_timeout=0.5, hooks=[SlowAfterStep(2, 0.9)])
    trainer.train()
    (stall,) = stalls(read_events(tmp_path))
    assert (stall["state"], stall["step"]) == ("ACCUMULATE", 2)
    assert stall["hook"] == "SlowAfterStep.on_after_step"
    assert stall["doing"] == "hook SlowAfterStep.on_after_step"


def test_a_checkpoint_write_that_blocks_is_named_as_a_checkpoint_write_in_the_checkpoint_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checkpoint_io.DurableWriter._write_at
    blocked = []

    def slow_write(self: Any, view: memoryview, offset: int) -> None:
        # The first buffer of the first save (not of RESTORE's disk probe): a file system that stalls.
        if not blocked and not self._path.name.startswith(".tmp-probe-"):
            blocked.append(1)
            time.sleep(1.0)
        real(self, view, offset)

    monkeypatch.setattr(checkpoint_io.DurableWriter, "_write_at", slow_write)
    trainer = TinyTrainer(max_steps=4, workspace=tmp_path, stall_timeout=0.5, hooks=[CheckpointingHook(interval=2)])
    trainer.train()
    stall, *again = stalls(read_events(tmp_path))  # again at 1 s, if the write's own time added up to it
    assert [s["report"] for s in again] in ([], [2])
    assert (stall["state"], stall["step"]) == ("CHECKPOINT", 2)
    assert stall["hook"] == "CheckpointingHook.on_enter_checkpoint"
    assert "checkpoint file" in stall["doing"] and "in a checkpoint save" in stall["doing"]
    assert stall["doing"].endswith("in hook CheckpointingHook.on_enter_checkpoint")
    saved = [e["saved_step"] for e in read_events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert saved == [2, 4]  # the stalled save went on and completed


# ---------------------------------------------------------------- no false alarms
# Floors far below every slow part (0.1 s against 0.1 s), so the learned budgets carry the test.
SMALL = AutoBudgets(
    build=5.0, restore=5.0, first_step=5.0, step_floor=0.05, step_multiple=10.0, checkpoint_floor=0.05, exit=5.0
)


class Uneven(TinyTrainer):
    """Steps of ``base`` seconds; the first, a validation (on_evaluate) and a save ``slow`` x longer."""

    def __init__(self, base: float, slow: float, stall_at: int = -1, **kwargs: Any) -> None:
        super().__init__(batches=make_batches(64), **kwargs)
        self.base, self.slow, self.stall_at = base, slow, stall_at

    def forward(self, input: Any) -> Any:
        time.sleep(self.base * (self.slow if self.step == 1 else 1))
        if self.step == self.stall_at:
            time.sleep(3.0)
        return super().forward(input)


class SlowValidationAndSave(BaseHook):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_evaluate(self, trainer: BaseTrainer) -> None:
        if trainer.step == 20:
            time.sleep(self.seconds)

    def wants_checkpoint(self, trainer: BaseTrainer) -> bool:
        return trainer.step == 30

    def on_enter_checkpoint(self, trainer: BaseTrainer) -> None:
        time.sleep(self.seconds)


def test_auto_writes_no_stall_for_a_slow_first_step_validation_or_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watchdog, "AUTO", SMALL)  # budgets of a second, not minutes: the rules, faster
    trainer = Uneven(0.02, 5, max_steps=40, workspace=tmp_path, hooks=[SlowValidationAndSave(0.1)])
    trainer.train()
    assert stalls(read_events(tmp_path)) == []


def test_auto_with_the_same_budgets_reports_a_step_that_really_stalls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard of the test above: its budgets are tight enough to catch a stall."""
    monkeypatch.setattr(watchdog, "AUTO", SMALL)
    trainer = Uneven(0.02, 5, stall_at=25, max_steps=30, workspace=tmp_path, hooks=[SlowValidationAndSave(0.1)])
    trainer.train()
    found = stalls(read_events(tmp_path))
    assert found and found[0]["step"] == 25 and found[0]["doing"] == "forward"
    assert found[0]["budget"] < 3.0  # 10 x the slowest step so far (the first, 0.1 s), not first_step's 5 s


def test_auto_budgets_follow_the_documented_rules() -> None:
    class Mark:
        moves = 0

    dog = Watchdog(
        timeout="auto", action="record", progress=Mark(), trainer=None, event_log=None, micro=int, requeue=lambda: None
    )  # type: ignore[arg-type]
    assert [dog.budget(state) for state in ("BUILD", "RESTORE", "STEP", "EXIT")] == [600.0, 600.0, 600.0, 600.0]
    dog._steps.extend([0.5, 2.0, 1.0])
    assert dog.budget("ACCUMULATE") == 120.0  # the floor: 10 x 2 s is less
    dog._steps.append(30.0)
    assert dog.budget("STEP") == 300.0  # 10 x the slowest
    assert dog.budget("CHECKPOINT") == 300.0
    dog._saves.append(100.0)
    assert dog.budget("CHECKPOINT") == 400.0  # 4 x the slowest save
    assert (
        Watchdog(
            timeout=7, action="record", progress=Mark(), trainer=None, event_log=None, micro=int, requeue=lambda: None
        ).budget("BUILD")
        == 7.0
    )  # type: ignore[arg-type]


def test_exit_waiting_for_a_large_states_write_gets_the_time_its_bytes_take_and_only_then() -> None:
    class Mark:
        moves = 0

    clock = WriteTimes()
    dog = Watchdog(
        timeout="auto",
        action="record",
        progress=Mark(),
        trainer=None,
        event_log=None,
        micro=int,
        requeue=lambda: None,
        writes=lambda: (clock,),
    )  # type: ignore[arg-type]
    dog._bytes = 40_000_000_000  # a 40 GB state: 2,000 s at the 20 MB/s planned for
    assert dog.budget("EXIT", stuck=700.0) == 600.0  # no write in flight: a hang in EXIT is a stall
    clock.began = 0.0  # an asynchronous save's write in flight, which EXIT waits for
    assert dog.budget("EXIT", stuck=100.0) == 600.0  # not yet past the floor: the bytes are not asked for
    assert dog.budget("EXIT", stuck=700.0) == 2000.0  # the write, not a stall
    assert dog.budget("RESTORE", stuck=700.0) == 2000.0


# ---------------------------------------------------------------- the thread itself
def test_the_watchdog_thread_runs_only_inside_train_and_none_with_stall_timeout_none(tmp_path: Path) -> None:
    seen: list[bool] = []

    class Look(BaseHook):
        def on_after_step(self, trainer: BaseTrainer) -> None:
            seen.append(any(t.name == "trainfsm-watchdog" for t in threading.enumerate()))

    TinyTrainer(max_steps=2, hooks=[Look()]).train()
    assert seen == [True, True]
    assert not any(t.name == "trainfsm-watchdog" for t in threading.enumerate())
    seen.clear()
    TinyTrainer(max_steps=2, hooks=[Look()], stall_timeout=None).train()
    assert seen == [False, False]


def test_the_watchdog_looks_at_most_a_few_times_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    looks: list[float] = []
    real = Watchdog.look

    def counting(self: Watchdog, now: float) -> None:
        looks.append(now)
        real(self, now)

    monkeypatch.setattr(Watchdog, "look", counting)
    TinyTrainer(max_steps=3, script={}, batches=BlockingLoader(1, 2.0)).train()
    assert 6 <= len(looks) <= 5 * 2.5  # about 4 a second over the 2 s the loader blocks


def test_the_step_path_writes_the_progress_mark_once_per_transition(tmp_path: Path) -> None:
    trainer = TinyTrainer(max_steps=3, gradient_accumulation_steps=2, workspace=tmp_path, trail_form="full")
    trainer.train()
    transitions = [e for e in read_events(tmp_path) if e["event"] == "transition"]
    assert trainer._run is not None and trainer._run.machine.progress.moves == len(transitions)


# ---------------------------------------------------------------- stall_action="exit", one process
SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
import torch
from tests.helpers import TinyTrainer

parameter = torch.zeros(1, requires_grad=True)  # what a first step imports, before BUILD's half second
parameter.sum().backward()
torch.optim.SGD([parameter], lr=0.1).step()

class Stuck(TinyTrainer):
    def forward(self, input):
        if self.step == 3:
            time.sleep(60)  # stuck for good
        return super().forward(input)

Stuck(max_steps=6, workspace=sys.argv[1], stall_timeout=0.5, stall_action="exit").train()
print("not reached")
"""


@pytest.fixture(scope="module")
def stuck_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], float]:
    directory = tmp_path_factory.mktemp("stuck")
    script = directory / "stuck.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(directory / "ws")],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return directory / "ws", done, time.monotonic() - started


def test_with_exit_a_stalled_process_ends_with_status_75_and_exit_reason_stalled(stuck_run: Any) -> None:
    workspace, done, seconds = stuck_run
    assert done.returncode == STALL_EXIT_CODE == 75, done.stderr[-2000:]
    assert "not reached" not in done.stdout
    assert seconds < 30  # not the 60 s the forward sleeps
    events = read_events(workspace)
    (stall,) = stalls(events)
    assert (stall["state"], stall["step"], stall["action"], stall["doing"]) == ("ACCUMULATE", 3, "exit", "forward")
    assert events[-1]["event"] == "exit" and (events[-1]["reason"], events[-1]["code"]) == ("stalled", 75)
    assert "stall" in done.stderr  # people see it on the console too


def test_with_exit_the_trail_goes_up_to_the_stalled_step_before_the_process_ends(stuck_run: Any) -> None:
    """What the stuck thread had recorded but not written (steps 1-2, step 3's start: under the
    trail's half-second write-out) is written before the stall, not lost as in a SIGKILL."""
    workspace, _, _ = stuck_run
    (rank,) = audit.audit([workspace]).attempts[0].ranks
    assert (rank.steps_done, rank.end_state, rank.end_step) == (2, "ACCUMULATE", 3)


def test_trace_says_stalled_where_and_since_when(stuck_run: Any) -> None:
    workspace, _, _ = stuck_run
    events = read_events(workspace)
    (stall,) = stalls(events)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stall["ts"] - stall["seconds"]))
    text = trace.render(trace.trace([workspace]))
    assert text.startswith("attempt 0: stalled (exit code 75)")
    assert (
        f"  stalled: rank 0: stuck, then ended by the stall watchdog: in ACCUMULATE running step 3 since {since} UTC"
        in text
    )
    assert "forward at " in text and "Stuck.forward" in text


def test_audit_reports_the_stall_as_a_run_problem_with_exit_status_1(stuck_run: Any) -> None:
    workspace, _, _ = stuck_run
    report = audit.audit([workspace])
    assert report.problems == []  # the watchdog's lines do not break the replay
    assert [p.kind for p in report.run_problems] == ["stalled"]
    done = subprocess.run(
        [sys.executable, "-m", "trainfsm", "audit", str(workspace)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stdout
    assert ("[stalled] attempt 0 stalled: rank 0 in ACCUMULATE running step 3 for 0.") in done.stdout
    assert (
        " s: forward; the stall watchdog ended rank 0 (exit code 75); no later attempt (trainfsm trace tells more)"
    ) in done.stdout


def test_the_stall_line_is_json_with_the_schemas_fields(stuck_run: Any) -> None:
    from trainfsm.trail.schema import EVENT_FIELDS

    workspace, _, _ = stuck_run
    lines = (workspace / "logs" / "events.rank0.jsonl").read_text().splitlines()
    stall = next(json.loads(line) for line in lines if '"event":"stall"' in line)
    assert set(EVENT_FIELDS["stall"]) <= set(stall)


# ---------------------------------------------------------------- the whole life of the process
class BlockingIn(BaseHook):
    """Blocks in one hook method: ``on_before_train`` runs in RESTORE, ``on_after_train`` in EXIT."""

    def __init__(self, method: str, seconds: float) -> None:
        self.method, self.seconds = method, seconds

    def on_before_train(self, trainer: BaseTrainer) -> None:
        if self.method == "on_before_train":
            time.sleep(self.seconds)

    def on_after_train(self, trainer: BaseTrainer) -> None:
        if self.method == "on_after_train":
            time.sleep(self.seconds)


@pytest.mark.parametrize(
    ("method", "state", "step"), [("on_before_train", "RESTORE", 0), ("on_after_train", "EXIT", 3)]
)
def test_a_stall_in_restore_or_exit_is_recorded_in_that_state_with_the_hook_named(
    tmp_path: Path, method: str, state: str, step: int
) -> None:
    TinyTrainer(max_steps=3, workspace=tmp_path, stall_timeout=0.5, hooks=[BlockingIn(method, 0.9)]).train()
    events = read_events(tmp_path)
    (stall,) = stalls(events)
    assert (stall["state"], stall["step"], stall["hook"]) == (state, step, f"BlockingIn.{method}")
    cleared = [e for e in events if e["event"] == "stall_cleared"]
    assert [e["stalled_state"] for e in cleared] == [state]  # EXIT: cleared before the exit event
    assert events[-1]["event"] == "exit"


class SlowBuild(TinyTrainer):
    def build_model(self) -> torch.nn.Module:
        time.sleep(0.9)  # a model that takes long to build
        return super().build_model()


def test_a_stall_in_build_names_the_users_build_method(tmp_path: Path) -> None:
    SlowBuild(max_steps=2, workspace=tmp_path, stall_timeout=0.5).train()
    (stall,) = stalls(read_events(tmp_path))
    assert (stall["state"], stall["step"], stall["doing"]) == ("BUILD", 0, None)  # the user's code, not ours
    assert stall["stack"][-1].endswith(f"{line_of('# a model that takes long')} SlowBuild.build_model")


def test_the_audit_report_lists_each_stall_once_with_its_reports(tmp_path: Path) -> None:
    SleepyTrainer(max_steps=5, workspace=tmp_path, stall_timeout=0.3, sleep_at=2, seconds=1.3).train()
    data = audit.audit([tmp_path]).as_dict()
    (stall,) = data["attempts"][0]["stalls"]
    assert (stall["rank"], stall["state"], stall["step"], stall["doing"]) == (0, "ACCUMULATE", 2, "forward")
    assert stall["reports"] in (2, 3) and stall["cleared"] is not None and stall["cleared"] >= 1.0
    assert stall["at"].endswith("SleepyTrainer.forward")
    text = audit.render(audit.audit([tmp_path]))
    assert "  stall on rank 0: ACCUMULATE running step 2, " in text and "cleared after" in text


# ---------------------------------------------------------------- on CUDA (the GPU tier)
def kernel_cycles(seconds: float) -> int:
    """How many cycles ``torch.cuda._sleep`` spins for about ``seconds`` on this GPU, measured (the
    second of two measurements: the first may run before the clocks rise)."""
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10**8)
        end.record()
        end.synchronize()
    return int(10**8 * seconds * 1000 / start.elapsed_time(end))


class KernelStuckTrainer(TinyTrainer):
    """TinyTrainer on CUDA whose ``forward`` at ``stuck_at`` queues a kernel that spins ``cycles``:
    the host goes on queueing the step's work and waits at the step's first host read (the finite
    check's). Its forward reads nothing on the host."""

    def __init__(self, *, stuck_at: int, cycles: int, **kwargs: Any) -> None:
        super().__init__(device="cuda", **kwargs)
        self.stuck_at, self.cycles = stuck_at, cycles

    def forward(self, input: Any) -> Any:
        assert self.model is not None
        x, y = input["x"].to(self.device), input["y"].to(self.device)  # blocking copies: before the kernel
        if self.step == self.stuck_at:
            self.stuck_at = -1
            torch.cuda._sleep(self.cycles)  # a kernel that runs about 1.5 s
        return torch.nn.functional.mse_loss(self.model(x), y), {}


@pytest.mark.cuda
def test_a_step_stuck_in_a_cuda_kernel_is_named_where_the_host_waits_for_it(tmp_path: Path) -> None:
    # CUDA's and cuBLAS's first use (seconds, once per process) before the budgets under a second.
    TinyTrainer(max_steps=2, device="cuda").train()
    cycles = kernel_cycles(1.5)
    trainer = KernelStuckTrainer(max_steps=6, workspace=tmp_path, stall_timeout=0.5, stuck_at=3, cycles=cycles)
    trainer.train()
    events = read_events(tmp_path)
    stuck = [s for s in stalls(events) if s["step"] == 3]
    assert stuck, f"no stall at step 3: {stalls(events)}"
    first = stuck[0]
    # micro 1: the step's one micro-batch has run (forward and backward queued); the host waits after it.
    assert (first["state"], first["micro"], first["report"], first["collective"]) == ("ACCUMULATE", 1, 1, None)
    assert first["doing"] == (
        "the finite check of the gradients, whose host read waits for the GPU's queued kernels, "
        "in the gradients' finite check and clipping"
    )
    assert first["stack"][-1].split(" ")[-1] == "FiniteCheck.__call__"
    assert 0.5 <= first["seconds"] < 0.5 + 0.3
    (cleared,) = [e for e in events if e["event"] == "stall_cleared" and e["stalled_step"] == 3]
    # The kernel's time, seen to a look (a quarter second) each end; its clock may differ from the
    # measurement's by a boost step, hence the wide bounds.
    assert 0.75 <= cleared["seconds"] < 3.0
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "completed"
