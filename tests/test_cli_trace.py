"""``trainfsm trace``: the story of failed, preempted and killed attempts, from real trails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli_helpers import audit_json, cli, index_of, preempted, read_lines, run, trail, write_lines


def test_a_failed_run_shows_the_exception_with_its_traceback_and_the_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(tmp_path, steps=6, interval=2, script={5: ValueError("boom in forward")})
    run(tmp_path, steps=6, interval=2)
    code, out, _ = cli(capsys, "trace", tmp_path)
    assert code == 0
    events = trail(tmp_path)
    lines = read_lines(events)
    exception_line = index_of(lines, event="exception") + 1
    assert out.startswith("attempt 0: failed (exit code 1)\n")
    assert f"rank 0: the trail ends in EXIT at step 5 ({events}:{exception_line + 2})" in out
    assert f"exception ({events}:{exception_line}): ValueError: boom in forward" in out
    assert "Traceback (most recent call last):" in out
    assert 'tests/helpers.py", line' in out and "raise action" in out  # the frame that raised
    assert "transition trigger=fail source=ACCUMULATE dest=EXIT" in out
    assert f"next: attempt 1 resumed from checkpoint {tmp_path / 'checkpoints' / '4'} (step 4)" in out
    assert "it ended completed at step 6" in out
    assert "attempt 1" not in out.split("next:")[0]  # the completed attempt has no story of its own
    assert out.rstrip().splitlines()[-1] == "run ended well: attempt 1 completed (exit code 0)"  # it was resumed


def test_n_limits_the_events_shown_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, steps=6, interval=2, script={5: ValueError("boom")})
    code, out, _ = cli(capsys, "trace", tmp_path, "-n", "3")
    assert code == 1  # the run failed and nothing resumed it
    assert "last 3 events:" in out
    shown = [line for line in out.splitlines() if line.startswith("      :")]
    assert len(shown) == 3
    assert shown[-1].endswith("exit reason=failed code=1")
    assert "next: no later attempt in the trail" in out
    assert out.rstrip().splitlines()[-1] == "run problems: failed"


def test_a_preempted_run_shows_the_signal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preempted(tmp_path, steps=6, at=3)
    code, out, _ = cli(capsys, "trace", tmp_path)
    assert code == 0
    assert out.startswith("attempt 0: preempted (exit code 138)")
    assert "signal_agreed signal=SIGUSR1 agreed_step=3" in out
    assert "checkpoint_saved" in out


def test_a_killed_attempt_is_traced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path / "real", steps=6, interval=2, script={5: ValueError("boom")})
    events = read_lines(trail(tmp_path / "real"))
    cut = index_of(events, event="checkpoint_saved", saved_step=4) + 1
    path = write_lines(tmp_path / "events.rank0.jsonl", events[:cut])
    code, out, _ = cli(capsys, "trace", path)
    assert code == 1  # killed, and no later attempt resumed it
    since = events[cut - 1]["ts"] - events[cut - 2]["ts"]
    assert out.startswith(
        f"attempt 0: killed at its last record (rank 0 at {path}:{cut}, CHECKPOINT at step 4, "
        f"{since:.2f} s after the record before it); no exit event"
    )
    assert f"the trail ends in CHECKPOINT at step 4 ({path}:{cut})" in out
    assert out.rstrip().splitlines()[-1] == "run problems: killed"


@pytest.mark.parametrize(
    "last",
    [
        # Steps 6-7 done, 8 begun (step 5, the first after the save, is written verbatim: the data
        # ledger's batch fingerprint came in its middle).
        pytest.param({"event": "steps", "first": 6}, id="compact-steps-6-7"),
        pytest.param({"event": "transition", "trigger": "resume", "step": 4}, id="into-STEP-after-checkpoint-4"),
    ],
)
def test_a_trail_that_ends_in_step_gives_one_step_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], last: dict[str, object]
) -> None:
    # Both records put the trainer in STEP one step further than their own ``step`` field says: it
    # counts a step on entering STEP. Every line of trace (and audit) names the step being run.
    run(tmp_path / "real", steps=8, interval=4)
    events = read_lines(trail(tmp_path / "real"))
    cut = index_of(events, **last) + 1
    running = events[cut - 1]["step"] + 1
    path = write_lines(tmp_path / "events.rank0.jsonl", events[:cut])
    code, out, _ = cli(capsys, "trace", path)
    assert code == 1
    where = f"rank 0 at {path}:{cut}, STEP running step {running}, "
    assert out.startswith(f"attempt 0: killed at its last record ({where}")
    assert f"  rank 0: the trail ends in STEP running step {running} ({path}:{cut})\n" in out
    summary = [line for line in out.splitlines() if not line.startswith("      :")]  # not the events' own fields
    assert {int(n) for line in summary for n in re.findall(r"\bstep (\d+)", line)} == {running}
    code, report = audit_json(capsys, path)
    (killed,) = report["attempts"][0]["killed_at"]
    assert code == 1 and (killed["state"], killed["step"]) == ("STEP", running)
    assert f"its trail ends in STEP running step {running}," in report["run_problems"][0]["message"]


def test_an_inconsistent_trail_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path / "real", steps=4, interval=2, trail_form="full")
    events = read_lines(trail(tmp_path / "real"))
    i = index_of(events, event="transition", trigger="stepped", step=3)
    events[i]["trigger"] = "resume"  # not a row of the machine
    code, out, _ = cli(capsys, "trace", write_lines(tmp_path / "events.rank0.jsonl", events))
    assert code == 3 and out.startswith("Nothing to trace")
    assert out.rstrip().splitlines()[-2:] == [
        "INCONSISTENT: 1 problem",
        "run ended well: attempt 0 completed (exit code 0)",
    ]


def test_a_completed_run_has_nothing_to_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, steps=2, interval=1)
    code, out, _ = cli(capsys, "trace", tmp_path)
    assert code == 0 and out.startswith("Nothing to trace") and "completed" in out


def test_unreadable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.rank0.jsonl"
    path.write_text("{not json}\n")
    code, _, err = cli(capsys, "trace", path)
    assert code == 2 and f"{path}:1: not JSON" in err
