"""The examples and the demo run end to end, as a user runs them, and leave their files where they say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import trail_events
from trainfsm.tools import demo

ROOT = Path(__file__).resolve().parents[1]


def _trainfsm() -> list[str]:
    """The installed console script, as a user runs it; ``python -m trainfsm`` where it is not installed."""
    script = Path(sys.executable).with_name("trainfsm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainfsm"]


def _events(path: Path) -> list[dict[str, Any]]:
    assert path.is_file(), f"no audit trail at {path}"
    return trail_events(path)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{argv} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_quickstart_runs_and_completes(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    _run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "12", "--workspace", str(workspace)],
        tmp_path,
    )
    events = _events(workspace / "logs" / "events.rank0.jsonl")
    exits = [e for e in events if e["event"] == "exit"]
    assert [(e["reason"], e["code"]) for e in exits] == [("completed", 0)]
    assert events[-1]["event"] == "exit" and events[-1]["step"] == 12
    assert (workspace / "checkpoints" / "latest").exists()


def test_demo_command_writes_checkpoints_and_audit_trail(tmp_path: Path) -> None:
    result = _run([*_trainfsm(), "demo", "--steps", "30", "--workspace", "tmp"], tmp_path)
    workspace = tmp_path / "tmp"
    assert (workspace / "checkpoints" / "latest").exists()
    assert (workspace / "checkpoints" / "30" / "manifest.json").is_file()
    events = _events(workspace / "logs" / "events.rank0.jsonl")
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "completed"
    # The end of the output says where the files are, and what accuracy the run reached.
    assert "Validation accuracy:" in result.stdout
    assert str((workspace / "checkpoints").resolve()) in result.stdout
    assert str((workspace / "logs" / "events.rank0.jsonl").resolve()) in result.stdout
    assert "step   30/30" in result.stderr  # the progress line, through logging


def test_demo_trail_gives_plot_its_loss_and_learning_rate_curves(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trainfsm.tools.plot import plot

    demo.run(tmp_path, steps=20, log_every=5)
    result = plot([tmp_path], tmp_path / "run.png")
    assert result.metrics == ["loss", "lr/group_0"]


@pytest.mark.slow
def test_demo_default_steps_learn_the_digits_and_a_rerun_resumes(tmp_path: Path) -> None:
    first = demo.run(tmp_path, log_every=1000)
    assert first.step == demo.DEFAULT_STEPS and first.start_step == 0 and first.exit_reason == "completed"
    assert first.val_accuracy > 0.9
    assert first.latest == str(demo.DEFAULT_STEPS)

    again = demo.run(tmp_path, log_every=1000)  # same steps: restored, nothing left to train
    assert again.start_step == demo.DEFAULT_STEPS and again.attempt == 1
    assert again.val_accuracy == first.val_accuracy
    assert "Nothing to train" in demo.summary(again)

    more = demo.run(tmp_path, demo.DEFAULT_STEPS + 20, log_every=1000)
    assert (more.start_step, more.step, more.attempt) == (demo.DEFAULT_STEPS, demo.DEFAULT_STEPS + 20, 2)
    assert "Resumed from the checkpoint at step" in demo.summary(more)


def test_demo_without_scikit_learn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(demo.DemoError, match=r"trainfsm\[demo\]"):
        demo.load_digits_split()


def test_demo_command_usage_errors_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [*_trainfsm(), "demo", "--steps", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--steps" in result.stderr
