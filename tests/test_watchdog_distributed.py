"""The stall watchdog with two ranks under torchrun (issue 33): real gloo ranks, a rank frozen with
SIGSTOP or a forward that sleeps; the other rank's trail names the collective it waits in, ``trace``
names the rank that holds the job, ``stall_action="exit"`` restarts the job from its newest
checkpoint. Worker: ``tests/faults/stall.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import events
from tests.faults import stall
from tests.faults.elastic_restart import reap
from trainfsm.tools import audit, trace
from trainfsm.tools.report import render
from trainfsm.tools.words import RUNNING

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="torchrun, SIGSTOP: Linux"),
    pytest.mark.distributed,
    pytest.mark.faults,
]

BUDGET = 4.0  # seconds: every state's, so BUILD on a busy machine stays under it
GROUP_TIMEOUT = 12.0  # seconds: the process group's, for the frozen rank's collective to fail


def wait_for(what: Any, process: Any, log: Path, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = what()
        if found:
            return found
        assert process.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)


def stalls(workspace: Path, rank: int, attempt: int = 0) -> list[dict[str, Any]]:
    return [e for e in events(workspace, rank) if e["event"] == "stall" and e["attempt"] == attempt]


def training_past(workspace: Path, rank: int, step: int) -> bool:
    return any(e["step"] >= step and e["event"] in ("steps", "transition") for e in events(workspace, rank))


def freeze(workspace: Path, rank: int) -> tuple[int, float]:
    pid = int((workspace / f"pid.rank{rank}").read_text())
    os.kill(pid, signal.SIGSTOP)
    return pid, time.time()


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """The uninterrupted run's final parameters."""
    directory = tmp_path_factory.mktemp("straight")
    process = stall.torchrun(directory / "ws", directory / "log", "--stall-timeout", str(BUDGET))
    try:
        assert process.wait(timeout=240) == 0, (directory / "log").read_text()[-3000:]
    finally:
        reap(process)
    return torch.load(directory / "ws" / "final.pt")  # type: ignore[no-any-return]


def test_a_frozen_rank_makes_the_other_record_the_collective_it_waits_in_and_stays_the_cause_after_the_timeout(
    tmp_path: Path,
) -> None:
    """Read while the job hangs, then again once the process group's timeout failed rank 0's
    collective (issue 51): the same cause (rank 1, frozen) both times, and one step number per rank
    (rank 0 wrote out its queued records at its first stall report)."""
    workspace, log = tmp_path / "ws", tmp_path / "log"
    process = stall.torchrun(workspace, log, "--stall-timeout", str(BUDGET), "--timeout", str(GROUP_TIMEOUT))
    pid = None
    try:
        wait_for(lambda: training_past(workspace, 1, 12), process, log)
        pid, frozen_at = freeze(workspace, 1)
        (first, *_) = wait_for(lambda: stalls(workspace, 0), process, log, timeout=60)
        text = trace.render(trace.trace([workspace]))
        report = audit.audit([workspace])
        before = text, report

        def failed() -> bool:
            return any(e["event"] == "exit" for e in events(workspace, 0))

        wait_for(failed, process, log, timeout=60)
        after = trace.render(trace.trace([workspace])), audit.audit([workspace])
    finally:
        reap(process, [pid] if pid else [])
    assert first["collective"] is not None, first
    assert first["state"] in ("STEP", "ACCUMULATE", "CHECKPOINT") and first["report"] == 1  # CHECKPOINT: its barrier
    assert first["ts"] - frozen_at <= BUDGET + 2, (first["ts"] - frozen_at, first)
    assert "held up by: rank 1: no record for " in text, text
    assert "frozen or killed" in text
    assert f"waiting: rank 0: in {trace.position(first['state'], first['step'])}" in text
    assert first["collective"] in text
    assert "cause: killed" not in text  # nobody was killed: rank 0 waits, rank 1 is frozen
    assert stalls(workspace, 1) == []  # frozen: its watchdog is frozen with it
    (stalled,) = [p for p in report.run_problems if p.kind == "stalled"]
    assert stalled.message.startswith(
        "attempt 0 stalled: rank 1 went quiet (frozen or killed) while the others waited; "
    )
    assert f"rank 0 in {trace.position(first['state'], first['step'])} for " in stalled.message

    (stall0, *_) = stalls(workspace, 0)
    assert stall0["collective"] is not None, stall0
    note = next(e for e in events(workspace, 0) if e["event"] == "collective_failed")["note"]
    assert "after waiting in it for" in note and "The cause is the stall" in note, note
    assert "the first 'exception' event" not in note  # a frozen rank has none
    for when, (text, read) in (("hanging", before), ("after the timeout", after)):
        why = f"{when}:\n{text}\n{render(read)}"
        # the cause: rank 1, frozen; rank 0 waits in a collective (its stall is not cleared by the timeout)
        assert "held up by: rank 1: no record for " in text and "frozen or killed" in text, why
        assert "cause: killed" not in text and "cleared after" not in text, why
        assert {p.kind for p in read.run_problems} == {"killed", "stalled"}, why
        (stalled,) = [p for p in read.run_problems if p.kind == "stalled"]
        assert stalled.message.startswith(
            "attempt 0 stalled: rank 1 went quiet (frozen or killed) while the others waited; "
        ), why
        # one step number per rank: rank 0's trail reaches its stall's step (its queued records were
        # written out at the first report), and trace and audit word each rank's step the same way
        (attempt,) = read.attempts
        rank0, rank1 = attempt.ranks
        where0 = trace.position(stall0["state"], stall0["step"])
        # steps done: those before the one it stalled in, if it stalled running one (not in CHECKPOINT)
        assert rank0.last_step == stall0["step"] - (stall0["state"] in RUNNING), why
        assert f"waiting: rank 0: in {where0} " in text and f"rank 0 in {where0} for " in stalled.message, why
        assert f"stall on rank 0: {where0}, " in render(read), why
        where1 = trace.position(rank1.end_state, rank1.end_step)
        assert f"last in {where1} (" in text and f"rank 1: the trail ends in {where1} (" in text, why
        (killed,) = [p for p in read.run_problems if p.kind == "killed"]
        assert f"its trail ends in {where1}," in killed.message, why
    assert f"rank 0: the trail ends in {where0} (" in before[0]
    assert "after a stall: the collective rank 0 waited in failed" in after[0]


@pytest.mark.slow  # the fast tier's distributed stall is the frozen rank above
def test_a_forward_sleeping_on_one_rank_names_its_line_there_and_the_collective_on_the_other(
    tmp_path: Path, straight: list[torch.Tensor]
) -> None:
    workspace, log = tmp_path / "ws", tmp_path / "log"
    sleep = ("--sleep-rank", "1", "--sleep-at", "20", "--sleep", str(BUDGET + 3))
    process = stall.torchrun(workspace, log, "--stall-timeout", str(BUDGET), *sleep)
    try:
        assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        reap(process)
    sleeper, *_ = stalls(workspace, 1)
    line = next(
        n
        for n, text in enumerate(Path(stall.__file__).read_text().splitlines(), 1)
        if "# the forward that stalls" in text
    )
    assert (sleeper["state"], sleeper["step"], sleeper["doing"]) == ("ACCUMULATE", 20, "forward")
    assert sleeper["stack"][-1] == f"{Path(stall.__file__).resolve()}:{line} child.<locals>.Stalling.forward"
    waiter, *_ = stalls(workspace, 0)
    assert waiter["collective"] is not None and waiter["step"] in (20, 21), waiter
    for rank in (0, 1):  # both moved on when the forward returned
        assert [e["event"] for e in events(workspace, rank)].count("stall_cleared") == 1
    report = audit.audit([workspace])
    assert report.problems == [] and report.run_problems == []  # stalls that cleared: the run ended well
    final = torch.load(workspace / "final.pt")
    assert all(torch.equal(a, b) for a, b in zip(final, straight, strict=True))


@pytest.mark.slow
def test_with_exit_a_frozen_rank_restarts_the_job_from_the_newest_checkpoint_and_it_ends_bit_exact(
    tmp_path: Path, straight: list[torch.Tensor]
) -> None:
    workspace, log = tmp_path / "ws", tmp_path / "log"
    process = stall.torchrun(workspace, log, "--stall-timeout", str(BUDGET), "--stall-action", "exit", max_restarts=1)
    pid = None
    try:
        wait_for(lambda: training_past(workspace, 1, 25), process, log)
        pid, _ = freeze(workspace, 1)

        def stalled_exit() -> bool:
            return any(e["event"] == "exit" and e["reason"] == "stalled" for e in events(workspace, 0))

        wait_for(stalled_exit, process, log, timeout=60)
        kill(pid)  # what a launcher does to a worker that does not stop: torchrun would, after 30 s
        assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        reap(process, [pid] if pid else [])
    first = [e for e in events(workspace, 0) if e["attempt"] == 0]
    (stall_event, *_) = [e for e in first if e["event"] == "stall"]
    assert stall_event["collective"] is not None and stall_event["action"] == "exit"
    assert (first[-1]["event"], first[-1]["reason"], first[-1]["code"]) == ("exit", "stalled", 75)
    newest = max(e["saved_step"] for e in first if e["event"] == "checkpoint_saved")
    second = [e for e in events(workspace, 0) if e["attempt"] == 1]
    loaded = next(e for e in second if e["event"] == "checkpoint_loaded")
    assert loaded["from_step"] == newest
    assert (second[-1]["event"], second[-1]["reason"]) == ("exit", "completed")
    final = torch.load(workspace / "final.pt")
    assert all(torch.equal(a, b) for a, b in zip(final, straight, strict=True))
    assert audit.audit([workspace]).run_problems == []
