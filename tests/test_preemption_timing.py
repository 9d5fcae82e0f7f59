"""``trainfsm audit`` times each preemption (issue 34, item 3): signal received, step finished, ranks
agreed, checkpoint durable and exit, in seconds after the signal; under SLURM the job's end and the
margin left at exit, and a note when that margin is thin. On real (short, CPU) trails; SLURM is the
stand-in of ``tests.fake_slurm`` (the real cluster: tests/slurm/test_job_end.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli_helpers import audit_json, cli, preempted, read_lines, trail
from tests.fake_slurm import FakeSlurm
from tests.helpers import TinyTrainer, read_events
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.tools import audit
from trainfsm.tools.preemption_timing import THIN_MARGIN

MARKS = (
    r"step finished \+(\d+\.\d\d) s, ranks agreed \+(\d+\.\d\d) s, checkpoint durable \+(\d+\.\d\d) s, "
    r"exit \+(\d+\.\d\d) s"
)


def preemption_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("preemption:")]


def test_a_preempted_run_outside_slurm_is_timed_from_the_signal_to_the_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGUSR1 as step 3 begins: one text line with the four marks, rising, and no job end (no
    SLURM); the JSON entry has the same figures, measured from the trail's own times."""
    preempted(tmp_path, steps=6, at=3)
    events = read_events(tmp_path)
    code, out, _ = cli(capsys, "audit", tmp_path)
    assert code == 0
    [line] = preemption_lines(out)
    found = re.fullmatch(rf"preemption: SIGUSR1 at step 3; {MARKS}", line)
    assert found, line
    marks = [float(x) for x in found.groups()]
    assert marks == sorted(marks)

    _, report = audit_json(capsys, tmp_path)
    timing = report["attempts"][0]["preemption"]
    [received] = [e for e in events if e["event"] == "signal_received"]
    [agreed] = [e for e in events if e["event"] == "signal_agreed"]
    [saved] = [e for e in events if e["event"] == "checkpoint_saved"]
    assert (timing["cause"], timing["signal"], timing["at"]) == ("signal", "SIGUSR1", received["received_at"])
    assert (timing["at_step"], timing["agreed_step"], agreed["agreed_step"]) == (3, 3, 3)
    assert timing["step_finished"] == round(agreed["step_ended_at"] - received["received_at"], 3)
    assert timing["agreed"] == round(agreed["ts"] - received["received_at"], 3)
    assert timing["durable"] == round(saved["ts"] - received["received_at"], 3)
    assert timing["exit"] == round(events[-1]["ts"] - received["received_at"], 3)
    assert (timing["job_end"], timing["margin"], timing["warning"], timing["save_after_end"]) == (
        None,
        None,
        None,
        False,
    )
    assert not [n for n in report["notes"] if "job's end" in n["message"]]


def test_a_completed_run_has_no_preemption_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    TinyTrainer(max_steps=3, workspace=tmp_path).train()
    code, out, _ = cli(capsys, "audit", tmp_path)
    assert code == 0 and preemption_lines(out) == []
    assert audit_json(capsys, tmp_path)[1]["attempts"][0]["preemption"] is None


def test_a_trail_written_before_the_timing_fields_is_still_timed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trails from before issue 34 have no ``step_ended_at`` and no ``reason`` in ``signal_agreed``:
    the preemption is timed with what is there (no step finished) and the trail stays consistent."""
    preempted(tmp_path, steps=6, at=3)
    path = trail(tmp_path)
    lines = read_lines(path)
    for event in lines:
        if event["event"] == "signal_agreed":
            del event["step_ended_at"], event["reason"]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    code, out, _ = cli(capsys, "audit", tmp_path)
    assert code == 0, out
    [line] = preemption_lines(out)
    assert re.fullmatch(
        r"preemption: SIGUSR1 at step 3; ranks agreed \+\S+ s, checkpoint durable \+\S+ s, exit \+\S+ s", line
    )


class Signal(BaseHook):
    """SIGUSR1 at the end of ``step``; before it, ``before()`` (to move the job's end)."""

    def __init__(self, step: int, before: Any = None, exit_sleep: Any = None) -> None:
        self.step, self.before, self.exit_sleep = step, before, exit_sleep

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.step:
            if self.before is not None:
                self.before()
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_after_train(self, trainer: BaseTrainer) -> None:
        if self.exit_sleep is not None:  # a slow way out: EXIT's hooks (an upload, a wandb finish)
            time.sleep(max(0.0, self.exit_sleep()))


def run_in_slurm(workspace: Path, hook: Signal) -> list[dict[str, Any]]:
    with pytest.raises(SystemExit) as info:
        TinyTrainer(max_steps=20, workspace=workspace, hooks=[CheckpointingHook(interval=100), hook]).train()
    assert info.value.code == 128 + signal.SIGUSR1
    return read_events(workspace)


def test_under_slurm_the_margin_is_the_jobs_end_less_the_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide margin: the line adds the job's end after the signal and the margin at exit; no note."""
    slurm = FakeSlurm(tmp_path / "slurm", monkeypatch)
    end = slurm.end_in(600.0)
    events = run_in_slurm(tmp_path / "run", Signal(3))
    report = audit.audit([tmp_path / "run"])
    [line] = preemption_lines(audit.render(report))
    assert re.fullmatch(
        rf"preemption: SIGUSR1 at step 3; {MARKS}; deadline \+\d+\.\d s \(the time limit, KillWait not known\), "
        r"margin \d+\.\d s at exit",
        line,
    ), line
    timing = report.attempts[0].as_dict()["preemption"]
    assert timing["job_end"] == end and timing["job_end_read"] == "signal"
    assert timing["margin"] == round(end - events[-1]["ts"], 3) and timing["warning"] == round(end - timing["at"], 3)
    assert not [n for n in report.notes if "job's end" in n.message]


def test_a_thin_margin_is_a_note_with_the_lead_time_to_ask_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's end 2 s after the signal, and an EXIT hook that takes until 0.1 s before it: the
    margin is under a quarter of the warning. A note (the run ended well: audit exits 0) says so
    and how much lead time to ask for."""
    slurm = FakeSlurm(tmp_path / "slurm", monkeypatch)
    slurm.end_in(3600.0)
    ends: list[float] = []

    def move_the_end() -> None:
        ends.append(slurm.end_at(time.time() + 2.0))

    run_in_slurm(tmp_path / "run", Signal(3, move_the_end, exit_sleep=lambda: ends[0] - 0.1 - time.time()))
    report = audit.audit([tmp_path / "run"])
    assert report.consistent and report.ended_well
    timing = report.attempts[0].as_dict()["preemption"]
    assert timing["job_end"] == ends[0] and 0 < timing["margin"] < THIN_MARGIN * timing["warning"]
    [note] = [n for n in report.notes if "job's end" in n.message]
    took = timing["exit"]
    assert note.message.startswith(
        f"attempt 0: the SIGUSR1 preemption left {timing['margin']:.1f} s before the job's end at exit, under 25% "
        f"of its {timing['warning']:.1f} s warning. The way out took {took:.1f} s: ask for at least --signal=USR1@"
    ), note.message
    assert note.line == len(read_lines(trail(tmp_path / "run")))  # it points at the exit
    assert "notes:" in audit.render(report) and note.message in audit.render(report)
