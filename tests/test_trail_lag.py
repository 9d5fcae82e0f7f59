"""A SIGKILL at a random moment costs the trail at most one step or one second (issue: the trail tells
the truth about how a process ended). Real processes, real SIGKILL: ``tests/faults/trail_lag.py``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.faults import trail_lag
from tests.tiers import trial_counts

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="the trials are forked processes"), pytest.mark.faults]


def lag_trials(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run the trials in their own session, output to a file; the whole tree is reaped after."""
    out = tmp_path / "out.json"
    with open(out, "w") as stdout, open(tmp_path / "err.txt", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(Path(trail_lag.__file__)), "--json", "--seed", "20261125", *args],
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            process.wait(timeout=400)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode in (0, 1), (tmp_path / "err.txt").read_text()[-3000:]
    return json.loads(out.read_text())


@trial_counts(fast=2, full=20)
def test_one_process_killed_at_random_moments_keeps_its_trail_within_a_step_or_a_second(
    tmp_path: Path, trials: int
) -> None:
    result = lag_trials(tmp_path, "--trials", str(trials), "--step-seconds", "0.001", "0.05", "1")
    assert result["failed"] == []
    assert [(s["step_seconds"], s["trials"], s["passed"]) for s in result["summary"]] == [
        (0.001, trials, trials),
        (0.05, trials, trials),
        (1.0, trials, trials),
    ]
    by_time = {s["step_seconds"]: s for s in result["summary"]}
    assert by_time[1.0]["max_steps_behind"] <= 0  # long steps: written as each ends
    assert by_time[0.001]["max_seconds_behind"] <= 1.0  # short ones: within the write-out interval


@pytest.mark.distributed
@trial_counts(fast=1, full=7)
def test_one_rank_of_a_ddp_job_killed_at_random_moments_keeps_its_trail_within_a_step_or_a_second(
    tmp_path: Path, trials: int
) -> None:
    result = lag_trials(tmp_path, "--ddp", "--trials", str(trials), "--step-seconds", "0.001", "0.05", "1")
    assert result["failed"] == []
    assert [(s["trials"], s["passed"]) for s in result["summary"]] == [(trials, trials)] * 3
