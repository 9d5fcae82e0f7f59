"""The digits, NaN-retry and config-driven examples run end to end, as a user runs them, print what
they reached, and leave trails that ``trainfsm.tools.audit`` accepts."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainfsm.tools.audit import audit

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, f"{argv} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _audited(workspace: Path) -> list[dict[str, Any]]:
    """The trail's attempts, once the audit has found it consistent, with no problems."""
    report = audit([workspace])
    assert report.consistent and report.problems == [], [p.as_dict() for p in report.problems]
    attempts: list[dict[str, Any]] = report.as_dict()["attempts"]
    return attempts


@pytest.mark.slow
def test_digits_default_steps_reach_90_percent_validation_accuracy(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the digits ship inside scikit-learn (the demo extra)")
    workspace = tmp_path / "ws"
    started = time.perf_counter()
    result = _run([str(EXAMPLES / "digits.py"), "--workspace", str(workspace)], tmp_path)
    seconds = time.perf_counter() - started
    match = re.search(r"validation accuracy: ([0-9.]+) at step 300", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) > 0.9
    assert seconds < 60, f"the default run took {seconds:.1f} s"  # ~12 s here; it is meant to stay < 30 s
    assert "Step 300/300" in result.stdout  # ProgressHook's last line
    assert f"audit trail: {workspace / 'logs' / 'events.rank0.jsonl'}" in result.stdout
    (attempt,) = _audited(workspace)
    assert (attempt["steps_done"], attempt["checkpoint_steps"]) == (300, [100, 200, 300])
    assert attempt["exit"] == {"reason": "completed", "code": 0}


@pytest.mark.slow
def test_digits_resumes_and_reports_the_restored_accuracy(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the digits ship inside scikit-learn (the demo extra)")
    digits = [str(EXAMPLES / "digits.py"), "--workspace", "ws", "--val-every", "10"]
    _run([*digits, "--steps", "20"], tmp_path)
    again = _run([*digits, "--steps", "20"], tmp_path)  # nothing left to train: evaluates the restored model
    assert re.search(r"validation accuracy: [0-9.]+ at step 20", again.stdout), again.stdout
    first, second = _audited(tmp_path / "ws")
    assert first["last_step"] == 20 and (second["start"], second["resumed_from_step"]) == ("resume", 20)


@pytest.mark.slow
def test_digits_with_epochs_stops_when_the_data_runs_out_and_a_rerun_trains_nothing(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the digits ship inside scikit-learn (the demo extra)")
    digits = [str(EXAMPLES / "digits.py"), "--workspace", "ws", "--epochs", "2", "--steps", "1000"]
    first = _run(digits, tmp_path)
    # 1,437 training digits in batches of 64 with drop_last: 22 steps an epoch.
    assert re.search(r"validation accuracy: [0-9.]+ at step 44", first.stdout), first.stdout
    assert "exit reason: completed" in first.stdout
    again = _run(digits, tmp_path)
    assert re.search(r"validation accuracy: [0-9.]+ at step 44", again.stdout), again.stdout
    one, two = _audited(tmp_path / "ws")
    assert (one["steps_done"], one["checkpoint_steps"], one["exit"]) == (44, [44], {"reason": "completed", "code": 0})
    assert (two["resumed_from_step"], two["steps_done"], two["exit"]["reason"]) == (44, 0, "completed")


def test_nan_retry_retries_and_the_trail_shows_retry_transitions(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    result = _run([str(EXAMPLES / "nan_retry.py"), "--steps", "12", "--workspace", str(workspace)], tmp_path)
    # Every 7th micro-batch is poisoned, 2 micro-batches a step: retries at steps 4, 6, 9 and 11.
    assert "retries: 4 (RETRY transitions in the trail: 4, at steps [4, 6, 9, 11])" in result.stdout
    assert "exit reason: completed" in result.stdout
    events = (workspace / "logs" / "events.rank0.jsonl").read_text().splitlines()
    assert sum('"dest":"RETRY"' in line and '"trigger":"non_finite"' in line for line in events) == 4
    assert sum('"source":"RETRY"' in line and '"trigger":"retry"' in line for line in events) == 4
    (attempt,) = _audited(workspace)
    assert [(r["step"], r["retry"]) for r in attempt["retries"]] == [(4, 1), (6, 1), (9, 1), (11, 1)]
    assert attempt["steps_done"] == 12 and attempt["exit"] == {"reason": "completed", "code": 0}


@pytest.mark.slow  # 10 s; tests/test_examples.py trains and resumes the other examples in the fast tier
def test_config_example_builds_from_the_config_trains_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("cfgx", reason="the config example needs cfgx (pip install cfgx)")
    pytest.importorskip("specbuild", reason="the config example needs specbuild (pip install specbuild)")
    train = [str(EXAMPLES / "config" / "train.py"), "--workspace", "ws"]
    # A cfgx override on the command line: another learning rate than the config's 3e-3.
    first = _run([*train, "--steps", "20", "--set", "optimizer.lr=1e-3"], tmp_path)
    assert "exit reason: completed" in first.stdout and "lr_0 1.00e-03" in first.stdout
    assert re.search(r"final step 20: loss [0-9.]+, batch accuracy [0-9.]+", first.stdout), first.stdout
    second = _run([*train, "--steps", "30"], tmp_path)  # resumes from the checkpoint at step 20
    assert "final step 30" in second.stdout
    one, two = _audited(tmp_path / "ws")
    assert (one["last_step"], one["micro_batches"]) == (20, 40)  # gradient_accumulation_steps=2 in the config
    assert (two["start"], two["resumed_from_step"], two["last_step"]) == ("resume", 20, 30)
    assert [a["exit"] for a in (one, two)] == [{"reason": "completed", "code": 0}] * 2
