"""Helpers of the ``trainfsm audit / trace / plot / inspect`` tests: real runs and trail editing.

Runs are real ``TinyTrainer`` trainings (``tests/helpers.py``); crafted trails are real trails with
lines edited, removed or copied, so every field not under test is what the trainer writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import EVENTS_FILE, TinyTrainer
from trainfsm import BaseHook, CheckpointingHook
from trainfsm.tools.cli import main

USR1 = signal.SIGUSR1


class SignalAtStep(BaseHook):
    """Sends SIGUSR1 to this process once, as ``step`` begins (the signal arrives in STEP)."""

    def __init__(self, step: int) -> None:
        self.step: int | None = step

    def on_before_step(self, trainer: Any) -> None:
        if trainer.step == self.step:
            self.step = None
            os.kill(os.getpid(), USR1)


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    """Run ``trainfsm ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def audit_json(capsys: pytest.CaptureFixture[str], *paths: Any) -> tuple[int, dict[str, Any]]:
    code, out, err = cli(capsys, "audit", "--json", *paths)
    assert out, err
    return code, json.loads(out)


def run(workspace: Path, steps: int = 6, *, interval: int = 2, **kwargs: Any) -> TinyTrainer:
    """Train a TinyTrainer with a CheckpointingHook (every ``interval`` steps) in ``workspace``.

    A failure or preemption is what some tests want: it is left in the trail, not raised.
    """
    hooks = [CheckpointingHook(interval=interval), *kwargs.pop("hooks", ())]
    trainer = TinyTrainer(max_steps=steps, workspace=workspace, hooks=hooks, **kwargs)
    with contextlib.suppress(SystemExit, ValueError, RuntimeError):
        trainer.train()
    return trainer


def preempted(workspace: Path, steps: int = 6, at: int = 3) -> TinyTrainer:
    """A run that ``set_exit_signals`` makes exit with 138 when SIGUSR1 arrives as step ``at`` begins."""
    trainer = TinyTrainer(
        max_steps=steps, workspace=workspace, hooks=[CheckpointingHook(interval=100), SignalAtStep(at)]
    )
    trainer.set_exit_signals([USR1])
    with pytest.raises(SystemExit) as info:
        trainer.train()
    assert info.value.code == 128 + USR1
    return trainer


def trail(workspace: Path, rank: int = 0) -> Path:
    return workspace / EVENTS_FILE.parent / f"events.rank{rank}.jsonl"


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The file's lines as written (a compact ``steps`` record is one line), for line numbers."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, events: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(event) + "\n" for event in events))
    return path


def index_of(events: list[dict[str, Any]], **fields: Any) -> int:
    """The index of the first event with all of ``fields`` (the file line is index + 1)."""
    return next(i for i, e in enumerate(events) if all(e.get(k) == v for k, v in fields.items()))


def problems(report: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(kind, file name, line) of every problem."""
    return [(p["kind"], Path(p["file"]).name, p["line"]) for p in report["problems"]]
