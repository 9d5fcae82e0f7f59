"""The trail's exit code is the status the process ends with, as the shell sees it (real processes).

``tests/faults/exit_status.py`` trains a TinyTrainer and, at its third forward call, waits for a
Ctrl-C (SIGINT, which no exit policy names) or raises SystemExit or an exception from user code.
A process that Python ends with SIGINT has returncode -2 here and status 130 in a shell.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.faults.exit_status import HERE as SCRIPT
from tests.helpers import TinyTrainer
from trainfsm import BaseHook
from trainfsm.tools.audit import audit

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="real signals to child processes"), pytest.mark.faults]


def launch(workspace: Path, action: str, marker: Path | None = None) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(SCRIPT), "--workspace", str(workspace), "--action", action]
    command += ["--marker", str(marker)] if marker else []
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def shell_status(returncode: int) -> int:
    """What ``$?`` says: 128 + N for a process killed by signal N (subprocess's -N)."""
    return 128 - returncode if returncode < 0 else returncode


def trail(workspace: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (workspace / "logs" / "events.rank0.jsonl").read_text().splitlines()]


def test_ctrl_c_mid_training_is_interrupted_with_the_code_the_shell_sees(tmp_path: Path) -> None:
    workspace, marker = tmp_path / "run", tmp_path / "in_forward"
    process = launch(workspace, "wait", marker)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert process.poll() is None, process.communicate()[1].decode()
        assert time.monotonic() < deadline, "the script never reached its third forward call"
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGINT, err.decode()  # Python ends itself with SIGINT
    events = trail(workspace)
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["code"]) == ("exit", "interrupted", 130)
    assert events[-1]["code"] == shell_status(process.returncode)
    assert events[-1]["step"] == 3 and events[-2]["event"] == "transition" and events[-2]["trigger"] == "fail"
    assert [e["type"] for e in events if e["event"] == "exception"] == ["KeyboardInterrupt"]
    report = audit([workspace])
    assert report.consistent and [(p.kind, p.attempt) for p in report.run_problems] == [("interrupted", 0)]


@pytest.mark.parametrize(
    ("action", "status", "reason"),
    [
        pytest.param("exit:3", 3, "failed", marks=pytest.mark.slow),
        ("exit:none", 0, "stopped"),
        pytest.param("exit:message", 1, "failed", marks=pytest.mark.slow),
        pytest.param("error", 1, "failed", marks=pytest.mark.slow),
    ],
)
def test_system_exit_from_user_code_records_the_status_python_exits_with(
    tmp_path: Path, action: str, status: int, reason: str
) -> None:
    workspace = tmp_path / "run"
    process = launch(workspace, action)
    _, err = process.communicate(timeout=120)
    assert process.returncode == status, err.decode()
    exit_event = trail(workspace)[-1]
    assert (exit_event["event"], exit_event["reason"], exit_event["code"]) == ("exit", reason, process.returncode)
    report = audit([workspace])
    assert report.consistent and [p.kind for p in report.run_problems] == ([reason] if status else [])


class FailsInExit(BaseHook):
    def on_after_train(self, trainer: Any) -> None:
        raise RuntimeError("EXIT's own work failed")


def test_an_exit_callback_that_fails_during_a_ctrl_c_leaves_the_status_to_the_interrupt(tmp_path: Path) -> None:
    """EXIT's own failure is recorded, but KeyboardInterrupt is what leaves train(): code 130 stays."""
    trainer = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[FailsInExit()], script={3: KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    events = trail(tmp_path)
    assert [e["type"] for e in events if e["event"] == "exception"] == ["KeyboardInterrupt", "RuntimeError"]
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["code"]) == ("exit", "interrupted", 130)
