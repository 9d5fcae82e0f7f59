"""The trails the examples leave, run as a user runs them (briefly), are accepted by ``trainfsm audit``."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainfsm.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _trainfsm() -> list[str]:
    script = Path(sys.executable).with_name("trainfsm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainfsm"]


def _run(argv: list[str], cwd: Path, expect: int = 0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == expect, f"{argv} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _audit(workspace: Path) -> dict[str, Any]:
    """``trainfsm audit --json`` in this process (the console script itself is tested beside)."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = main(["audit", "--json", str(workspace)])
    report: dict[str, Any] = json.loads(output.getvalue())
    assert code == 0 and report["consistent"] and report["problems"] == [], report["problems"]
    return report


@pytest.mark.slow  # the fast tier runs it in test_examples.py and audits real runs in test_cli_audit.py
def test_the_quickstart_and_its_resume_are_accepted(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    quickstart = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--workspace", str(workspace)]
    _run([*quickstart, "--steps", "6"], tmp_path)
    _run([*quickstart, "--steps", "9"], tmp_path)
    first, second = _audit(workspace)["attempts"]
    assert (first["start"], first["last_step"], first["micro_batches"]) == ("launch", 6, 12)  # 2 per step
    assert (second["start"], second["resumed_from_step"], second["last_step"]) == ("resume", 6, 9)
    assert [a["exit"] for a in (first, second)] == [{"reason": "completed", "code": 0}] * 2


@pytest.mark.slow  # the fast tier runs the demo in test_examples.py
def test_the_demo_is_accepted(tmp_path: Path) -> None:
    _run([*_trainfsm(), "demo", "--steps", "20", "--checkpoint-every", "10", "--workspace", "ws"], tmp_path)
    (attempt,) = _audit(tmp_path / "ws")["attempts"]
    assert (attempt["steps_done"], attempt["checkpoint_steps"]) == (20, [10, 20])


@pytest.mark.slow  # the fast tier preempts it under SLURM: tests/slurm/test_preemption.py
def test_the_slurm_example_preempted_by_sigusr1_and_resumed_is_accepted(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    train = [sys.executable, str(ROOT / "examples" / "slurm" / "train.py"), "--workspace", str(workspace)]
    train += ["--steps", "30", "--interval", "10", "--step-seconds", "0.02"]
    process = subprocess.Popen(train, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    events = workspace / "logs" / "events.rank0.jsonl"
    deadline = time.monotonic() + 120
    while process.poll() is None and b'"event":"restore"' not in (events.read_bytes() if events.exists() else b""):
        assert time.monotonic() < deadline, "the example did not get to RESTORE"
        time.sleep(0.05)
    time.sleep(0.2)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGUSR1, err.decode()
    _run(train, tmp_path)
    first, second = _audit(workspace)["attempts"]
    assert first["exit"] == {"reason": "preempted", "code": 138}
    assert [s["signal"] for s in first["signals"]["received"]] == ["SIGUSR1"]
    assert second["exit"] == {"reason": "completed", "code": 0} and second["last_step"] == 30
    if first["steps_done"]:  # preempted while training: the resume starts after its checkpoint
        assert first["signals"]["agreed"]["step"] == first["last_step"] == second["resumed_from_step"]
