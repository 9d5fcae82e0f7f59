"""``trainfsm audit``: real trails are accepted with exact counts; edited ones are caught at their line.

Every trail here comes from a real training (TinyTrainer, CheckpointingHook, SIGUSR1 to this
process); the inconsistent ones are real trails with lines changed, removed or copied to a second
rank, so only what a test is about differs from what the trainer writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli_helpers import (
    SignalAtStep,
    audit_json,
    cli,
    index_of,
    preempted,
    problems,
    read_lines,
    run,
    trail,
    write_lines,
)
from tests.helpers import TinyTrainer, make_batches
from trainfsm import CheckpointingHook
from trainfsm.tools.audit import PROBLEM_KINDS, RUN_PROBLEM_KINDS, SCHEMA
from trainfsm.tools.words import position

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ real trails are consistent
def test_a_completed_run_is_consistent_with_exact_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, steps=6, interval=2, gradient_accumulation_steps=2)
    code, report = audit_json(capsys, tmp_path)
    assert code == 0 and report["consistent"] and report["problems"] == [] and report["notes"] == []
    (attempt,) = report["attempts"]
    assert attempt["attempt"] == 0 and attempt["ranks"] == [0]
    assert attempt["start"] == "launch" and attempt["resumed_from_step"] is None
    assert (attempt["first_step"], attempt["last_step"], attempt["steps_done"]) == (1, 6, 6)
    assert attempt["micro_batches"] == 12  # 2 per step
    assert attempt["retries"] == [] and attempt["loss_none"] == 0
    assert attempt["checkpoint_steps"] == [2, 4, 6]
    assert [c["step"] for c in attempt["checkpoints"]["saved"]] == [2, 4, 6]
    assert attempt["checkpoints"]["loaded"] == [] and attempt["checkpoints"]["skipped"] == []
    assert attempt["signals"] == {"received": [], "agreed": None}
    assert attempt["exit"] == {"reason": "completed", "code": 0} and not attempt["killed"]
    assert attempt["end"] == {"state": "EXIT", "step": 6}
    assert report["files"] == [
        {"path": str(trail(tmp_path)), "ranks": [0], "events": len(trail(tmp_path).read_text().splitlines())}
    ]


def test_the_text_report_says_what_happened(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, steps=4, interval=2)
    code, out, _ = cli(capsys, "audit", tmp_path)
    assert code == 0
    assert "attempt 0: launch, rank 0" in out
    assert "steps 1-4: 4 done, 4 micro-batches, retries: none" in out
    assert "checkpoints: saved 2, 4" in out
    assert "exit: completed, code 0" in out
    assert out.rstrip().splitlines()[-2:] == [
        "consistent: every transition is a row of the machine, steps follow on, the ranks agree",
        "run ended well: attempt 0 completed (exit code 0)",
    ]


def test_non_finite_retries_and_loss_none_are_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Forward call 3 gives NaN gradients (step 3 runs again), call 4 returns loss=None (skipped).
    run(tmp_path, steps=6, interval=2, max_non_finite_grad_retries=2, script={3: "nan", 4: "none"})
    code, report = audit_json(capsys, tmp_path)
    assert code == 0, report["problems"]
    (attempt,) = report["attempts"]
    assert attempt["retries"] == [{"step": 3, "retry": 1}]
    assert attempt["loss_none"] == 1
    assert attempt["micro_batches"] == 8  # 6 steps + 1 retried micro-batch + 1 skipped one
    assert attempt["steps_done"] == 6


def test_a_preempted_run_and_its_resume_are_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preempted(tmp_path, steps=6, at=3)
    run(tmp_path, steps=6, interval=100)
    code, report = audit_json(capsys, tmp_path)
    assert code == 0, report["problems"]
    first, second = report["attempts"]
    assert first["exit"] == {"reason": "preempted", "code": 138}
    ((received),) = first["signals"]["received"]
    assert (received["rank"], received["signal"], received["at_step"], received["at_state"]) == (
        0,
        "SIGUSR1",
        3,
        "STEP",
    )
    assert first["signals"]["agreed"] == {"signal": "SIGUSR1", "step": 3, "reason": "signal"}
    assert [c["step"] for c in first["checkpoints"]["saved"]] == [3]
    assert (first["first_step"], first["last_step"], first["steps_done"]) == (1, 3, 3)

    assert second["start"] == "resume" and second["resumed_from_step"] == 3
    assert [c["step"] for c in second["checkpoints"]["loaded"]] == [3]
    assert second["checkpoints"]["loaded"][0]["path"] == str(tmp_path / "checkpoints" / "3")
    assert (second["first_step"], second["last_step"], second["steps_done"]) == (4, 6, 3)
    assert second["exit"] == {"reason": "completed", "code": 0}


def test_a_failed_run_that_was_resumed_is_consistent_and_ended_well(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(tmp_path, steps=6, interval=2, script={5: ValueError("boom")})
    run(tmp_path, steps=6, interval=2)
    code, report = audit_json(capsys, tmp_path)
    assert code == 0, report["problems"]
    assert report["ended_well"] and report["run_problems"] == []
    failed, resumed = report["attempts"]
    assert failed["exit"] == {"reason": "failed", "code": 1}
    assert [(e["type"], e["message"]) for e in failed["exceptions"]] == [("ValueError", "boom")]
    assert failed["end"] == {"state": "EXIT", "step": 5} and failed["steps_done"] == 4
    assert resumed["resumed_from_step"] == 4 and resumed["first_step"] == 5


def test_json_schema_is_the_documented_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, steps=2, interval=1)
    _, report = audit_json(capsys, tmp_path)
    assert report["schema"] == SCHEMA == "trainfsm.audit/1"
    assert set(report) == {
        "schema", "consistent", "ended_well", "files", "attempts", "problems", "run_problems", "notes", "ledger",
        "ledger_checked",
    }  # fmt: skip
    (attempt,) = report["attempts"]
    assert set(attempt) == {
        "attempt", "ranks", "start", "resumed_from_step", "first_step", "last_step", "steps_done",
        "micro_batches", "loss_none", "retries", "scaler_skips", "checkpoint_steps", "checkpoints",
        "signals", "preemption", "exceptions", "stalls", "requeue", "exit", "ended", "torchelastic", "killed",
        "killed_at", "end",
        "started_at", "ended_at", "per_rank",
    }  # fmt: skip
    assert set(attempt["checkpoints"]) == {"saved", "loaded", "skipped", "failed"}
    assert set(attempt["checkpoints"]["saved"][0]) == {
        "step", "path", "kept", "asynchronous", "bytes", "checksum", "data", "ts",
    }  # fmt: skip
    assert set(attempt["per_rank"][0]) == {
        "rank", "file", "run_id", "world_size", "events", "first_step", "last_step", "steps_done",
        "micro_batches", "retry_steps", "checkpoint_steps", "loaded_step", "agreed_step", "exit", "end",
        "started_at", "ended_at",
    }  # fmt: skip


@pytest.mark.distributed
@pytest.mark.faults
@pytest.mark.slow
def test_a_real_two_rank_preemption_is_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.faults.two_ranks import scenario

    result = scenario(tmp_path)
    assert result["codes"] == {0: 138, 1: 138}, result
    code, report = audit_json(capsys, tmp_path)
    assert code == 0, report["problems"]
    (attempt,) = report["attempts"]
    assert attempt["ranks"] == [0, 1]
    assert {s["rank"] for s in attempt["signals"]["received"]} == {1}  # the signal went to rank 1 only
    agreed = attempt["signals"]["agreed"]["step"]
    assert [r["agreed_step"] for r in attempt["per_rank"]] == [agreed, agreed]
    assert [c["step"] for c in attempt["checkpoints"]["saved"]] == [agreed]  # rank 0 writes it
    assert [r["checkpoint_steps"] for r in attempt["per_rank"]] == [[agreed], [agreed]]
    assert [r["exit"] for r in attempt["per_rank"]] == [{"reason": "preempted", "code": 138}] * 2


def _killed_in_training(workspace: Path, out: Path) -> None:
    """Launch the kill_resume script and SIGKILL it a little after RESTORE (its last batch of
    transitions may be lost)."""
    from tests.faults.kill_resume import _count, _launch

    process = _launch(workspace, out, slow=0.0)
    deadline = time.monotonic() + 120
    while process.poll() is None and _count(workspace, "restore") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.25)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL


@pytest.mark.faults
def test_a_real_sigkill_not_resumed_is_a_run_problem_at_its_last_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = tmp_path / "ws"
    _killed_in_training(workspace, tmp_path / "out.pt")
    code, report = audit_json(capsys, workspace)
    assert code == 1 and report["consistent"] and not report["ended_well"], report["problems"]
    last = read_lines(trail(workspace))[-1]
    (killed,) = report["attempts"][0]["killed_at"]
    assert (killed["line"], killed["state"], killed["step"], killed["ts"]) == (
        len(read_lines(trail(workspace))), last["state"], last["step"], last["ts"],
    )  # fmt: skip
    assert killed["since_previous"] == last["ts"] - read_lines(trail(workspace))[-2]["ts"]
    assert [(p["kind"], p["rank"], p["attempt"], p["line"]) for p in report["run_problems"]] == [
        ("killed", 0, 0, killed["line"])
    ]
    assert f"ends in {position(last['state'], last['step'])}" in report["run_problems"][0]["message"]
    code, out, _ = cli(capsys, "audit", workspace)
    assert code == 1 and out.rstrip().splitlines()[-1] == "run problems: killed"
    assert f"killed at its last record ({trail(workspace)}:{killed['line']})" in out


@pytest.mark.faults
def test_a_real_sigkill_then_a_resume_is_consistent_and_ended_well(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.faults.kill_resume import _launch

    workspace, out = tmp_path / "ws", tmp_path / "out.pt"
    _killed_in_training(workspace, out)
    finished = _launch(workspace, out, slow=0.0)
    _, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err.decode()
    code, report = audit_json(capsys, workspace)
    assert code == 0 and report["problems"] == [] and report["run_problems"] == [] and report["ended_well"]
    killed, finished_attempt = report["attempts"]
    assert killed["killed"] and killed["exit"] is None and [k["rank"] for k in killed["killed_at"]] == [0]
    assert finished_attempt["exit"] == {"reason": "completed", "code": 0} and finished_attempt["last_step"] == 40
    assert finished_attempt["killed_at"] == []


def test_a_failed_run_not_resumed_is_a_run_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, steps=6, interval=2, script={5: ValueError("boom")})
    code, report = audit_json(capsys, tmp_path)
    assert code == 1 and report["consistent"] and not report["ended_well"]
    exit_line = index_of(read_lines(trail(tmp_path)), event="exit") + 1
    assert [(p["kind"], p["attempt"], p["line"]) for p in report["run_problems"]] == [("failed", 0, exit_line)]
    assert report["run_problems"][0]["message"] == (
        "attempt 0 failed on rank 0 at step 5 (exit code 1): ValueError: boom; no later attempt"
    )
    code, out, _ = cli(capsys, "audit", tmp_path)
    assert code == 1 and "\nrun problems:\n" in out and out.rstrip().endswith("\nrun problems: failed")
    assert out.rstrip().splitlines()[-2].startswith("consistent: ")


def test_a_refused_requeue_not_followed_by_an_attempt_is_a_run_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SLURM job submitted with --no-requeue: ``scontrol requeue`` fails, the job is gone. Here a
    real preempted run with SLURM's variables and an ``scontrol`` on PATH that fails as SLURM's does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'scontrol: error: Requested operation is presently disabled' >&2\nexit 1\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    workspace = tmp_path / "run"
    trainer = TinyTrainer(max_steps=6, workspace=workspace, hooks=[CheckpointingHook(interval=100), SignalAtStep(3)])
    trainer.set_exit_signals([signal.SIGUSR1], requeue=True)
    with pytest.raises(SystemExit) as info:
        trainer.train()
    events = read_lines(trail(workspace))
    requeue = events[index_of(events, event="requeue")]
    assert (requeue["ok"], requeue["command"]) == (False, "scontrol requeue 4242")
    assert "presently disabled" in requeue["message"]
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["code"]) == ("exit", "preempted", info.value.code)
    code, report = audit_json(capsys, workspace)
    assert code == 1 and report["consistent"], report["problems"]
    assert [(p["kind"], p["line"]) for p in report["run_problems"]] == [
        ("requeue_refused", index_of(events, event="requeue") + 1)
    ]
    assert "presently disabled" in report["run_problems"][0]["message"]

    run(workspace, steps=6, interval=100)  # resubmitted by hand: the run went on
    code, report = audit_json(capsys, workspace)
    assert code == 0 and report["run_problems"] == []


# ------------------------------------------------------------------ edited trails are caught
@pytest.fixture
def base(tmp_path: Path) -> list[dict[str, Any]]:
    """The events of a real 6-step run that checkpoints every 2 steps, every transition verbatim."""
    run(tmp_path / "real", steps=6, interval=2, trail_form="full")
    # Without the data ledger's batch fingerprints (written within the step after each save): these
    # tests edit transitions and count lines.
    return [e for e in read_lines(trail(tmp_path / "real")) if e["event"] != "batch_fingerprint"]


@pytest.fixture
def compact(tmp_path: Path) -> list[dict[str, Any]]:
    """The events of a real 8-step run of 2 micro-batches a step that checkpoints after step 4,
    routine steps compact."""
    run(tmp_path / "real", steps=8, interval=4, gradient_accumulation_steps=2, batches=make_batches(16))
    lines = read_lines(trail(tmp_path / "real"))
    # Step 5, the first after the save, is verbatim: its batch fingerprint came in between.
    # Step 1 is verbatim: it draws the first epoch's first batch (the ``epoch`` event, its fingerprint).
    assert [(e["first"], e["step"]) for e in lines if e["event"] == "steps"] == [(2, 3), (6, 7)]
    return lines


def test_compact_routine_steps_replay_like_their_transitions(
    tmp_path: Path, compact: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    run(
        tmp_path / "full",
        steps=8,
        interval=4,
        gradient_accumulation_steps=2,
        batches=make_batches(16),
        trail_form="full",
    )
    _, full = audit_json(capsys, trail(tmp_path / "full"))
    code, report = audit_json(capsys, trail(tmp_path / "real"))
    assert code == 0 and report["problems"] == []
    same = ("first_step", "last_step", "steps_done", "micro_batches", "checkpoint_steps", "end", "exit")
    assert {k: report["attempts"][0][k] for k in same} == {k: full["attempts"][0][k] for k in same}
    assert report["attempts"][0]["steps_done"] == 8 and report["attempts"][0]["micro_batches"] == 16


def test_compact_steps_taken_from_another_state_are_illegal(
    tmp_path: Path, compact: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(compact, event="steps", first=6)
    assert compact[i - 1] == {**compact[i - 1], "trigger": "stepped", "dest": "STEP"}
    del compact[i - 1]  # step 5's ACCUMULATE -> STEP is gone: the steps begin while the machine is in ACCUMULATE
    path = write_lines(tmp_path / "events.rank0.jsonl", compact)
    code, report = audit_json(capsys, path)
    # The step did not advance either (that happens on entering STEP): a gap at the same line.
    assert code == 3 and problems(report) == [("illegal_transition", path.name, i), ("gap", path.name, i)]
    assert (
        "micro: STEP -> ACCUMULATE (routine steps 6-7) taken while the machine was in ACCUMULATE"
        in (report["problems"][0]["message"])
    )


def test_compact_steps_that_skip_a_step_are_a_gap(
    tmp_path: Path, compact: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(compact, event="steps", first=2)
    compact[i]["first"], compact[i]["dt"] = 3, compact[i]["dt"][1:]  # step 2 is not in the trail
    path = write_lines(tmp_path / "events.rank0.jsonl", compact)
    code, report = audit_json(capsys, path)
    assert code == 3 and problems(report)[0] == ("gap", path.name, i + 1)
    assert report["problems"][0]["message"] == "step jumps from 2 to 3 (step 2 missing)"


def test_a_missing_compact_record_is_a_gap(
    tmp_path: Path, compact: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(compact, event="steps", first=6)
    del compact[i]  # steps 6-7: the next transition is written at step 8
    path = write_lines(tmp_path / "events.rank0.jsonl", compact)
    code, report = audit_json(capsys, path)
    assert code == 3 and problems(report) == [("gap", path.name, i + 1)]
    assert report["problems"][0]["message"] == "step jumps from 6 to 8"


def test_a_compact_record_whose_durations_do_not_add_up_is_unreadable(
    tmp_path: Path, compact: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(compact, event="steps", first=6)
    compact[i]["dt"].pop()
    path = write_lines(tmp_path / "events.rank0.jsonl", compact)
    code, _, err = cli(capsys, "audit", path)
    assert code == 2 and f"{path}:{i + 1}: a steps record of steps 6-7 needs one integer duration per step" in err


def test_a_transition_that_is_not_a_row_is_illegal(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(base, event="transition", trigger="stepped", step=3)
    base[i]["trigger"] = "resume"  # resume goes CHECKPOINT -> STEP, never ACCUMULATE -> STEP
    path = write_lines(tmp_path / "events.rank0.jsonl", base)
    code, report = audit_json(capsys, path)
    assert code == 3 and problems(report) == [("illegal_transition", path.name, i + 1)]
    assert "resume: ACCUMULATE -> STEP is not a row" in report["problems"][0]["message"]
    assert report["ended_well"] and not report["consistent"]  # a completed run, but not as the machine allows
    code, out, _ = cli(capsys, "audit", path)
    assert code == 3 and f"{path}:{i + 1}: [illegal_transition]" in out
    assert out.rstrip().splitlines()[-2:] == [
        "INCONSISTENT: 1 problem",
        "run ended well: attempt 0 completed (exit code 0)",
    ]


def test_an_inconsistent_trail_of_a_failed_run_exits_3_not_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(tmp_path / "real", steps=6, interval=2, script={5: ValueError("boom")}, trail_form="full")
    events = read_lines(trail(tmp_path / "real"))
    i = index_of(events, event="transition", trigger="stepped", step=3)
    events[i]["trigger"] = "resume"
    path = write_lines(tmp_path / "events.rank0.jsonl", events)
    code, report = audit_json(capsys, path)
    assert code == 3 and [p["kind"] for p in report["run_problems"]] == ["failed"]


def test_a_transition_from_another_state_is_illegal(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(base, event="transition", trigger="micro", step=3)
    del base[i]  # STEP -> ACCUMULATE is gone: "stepped" now leaves ACCUMULATE while the machine is in STEP
    path = write_lines(tmp_path / "events.rank0.jsonl", base)
    code, report = audit_json(capsys, path)
    assert code == 3 and problems(report) == [("illegal_transition", path.name, i + 1)]
    assert "taken while the machine was in STEP" in report["problems"][0]["message"]


def test_a_missing_step_is_a_gap(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(base, event="transition", trigger="micro", step=3)
    assert [base[i]["trigger"], base[i + 1]["trigger"]] == ["micro", "stepped"]
    del base[i : i + 2]  # all of step 3
    path = write_lines(tmp_path / "events.rank0.jsonl", base)
    code, report = audit_json(capsys, path)
    assert code == 3 and problems(report) == [("gap", path.name, i + 1)]
    assert report["problems"][0]["message"] == "step jumps from 3 to 4 (step 3 missing)"


def test_a_resume_that_does_not_start_after_its_checkpoint_is_a_gap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(tmp_path / "real", steps=4, interval=2)
    run(tmp_path / "real", steps=6, interval=2)
    events = read_lines(trail(tmp_path / "real"))
    i = index_of(events, event="checkpoint_loaded")
    events[i]["from_step"] = 2  # the restore event says 4
    path = write_lines(tmp_path / "events.rank0.jsonl", events)
    code, report = audit_json(capsys, path)
    assert code == 3 and problems(report) == [("gap", path.name, i + 3)]  # at the restore event after it
    assert "the checkpoint loaded was 2" in report["problems"][0]["message"]


def test_a_lost_transition_line_is_a_state_mismatch(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    i = index_of(base, event="transition", trigger="save", step=2)
    del base[i]
    path = write_lines(tmp_path / "events.rank0.jsonl", base)
    code, report = audit_json(capsys, path)
    assert code == 3 and problems(report) == [("state_mismatch", path.name, i + 1)]  # checkpoint_saved
    assert "written in CHECKPOINT, but the replay is in ACCUMULATE" in report["problems"][0]["message"]


def _as_rank(events: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    """The same events as written by ``rank`` of a 2-rank run."""
    out = []
    for event in events:
        event = {**event, "rank": rank}
        if event["event"] == "run_start":
            event["world_size"] = 2
        out.append(event)
    return out


def test_two_ranks_that_agree_are_consistent(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    write_lines(tmp_path / "run" / "logs" / "events.rank0.jsonl", _as_rank(base, 0))
    write_lines(tmp_path / "run" / "logs" / "events.rank1.jsonl", _as_rank(base, 1))
    code, report = audit_json(capsys, tmp_path / "run")
    assert code == 0 and report["attempts"][0]["ranks"] == [0, 1] and report["notes"] == []


def test_a_rank_that_stopped_a_step_early_disagrees(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    run(tmp_path / "short", steps=5, interval=2)  # saves at 2, 4 and 5 (the end)
    rank0 = write_lines(tmp_path / "events.rank0.jsonl", _as_rank(base, 0))
    rank1_events = _as_rank(read_lines(trail(tmp_path / "short")), 1)
    rank1 = write_lines(tmp_path / "events.rank1.jsonl", rank1_events)
    code, report = audit_json(capsys, rank0, rank1)
    assert code == 3
    exit_line = len(rank1_events)
    assert problems(report) == [("rank_disagreement", rank1.name, exit_line)] * 2
    messages = [p["message"] for p in report["problems"]]
    assert messages == [
        "attempt 0: steps done: rank 0 6 (steps 1-6), rank 1 5 (steps 1-5)",
        "attempt 0: checkpoint steps: rank 0 [2, 4, 6], rank 1 [2, 4, 5]",
    ]


def test_a_rank_that_skipped_a_micro_batch_alone_disagrees(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Forward call 4 returned loss=None on rank 1 only: DDP's all-reduce would have paired rank 0's
    # step 4 gradients with rank 1's step 5 ones. The audit names the micro-batch.
    run(tmp_path / "skip", steps=6, interval=2, script={4: "none"})
    write_lines(tmp_path / "run" / "logs" / "events.rank0.jsonl", _as_rank(base, 0))
    rank1_events = _as_rank(read_lines(trail(tmp_path / "skip")), 1)
    write_lines(tmp_path / "run" / "logs" / "events.rank1.jsonl", rank1_events)
    code, report = audit_json(capsys, tmp_path / "run")
    assert code == 3 and problems(report) == [("rank_disagreement", "events.rank1.jsonl", len(rank1_events))]
    message = report["problems"][0]["message"]
    assert message == "attempt 0: loss=None micro-batches: rank 0 none, rank 1 ['step 4 micro 0']"


def test_ranks_that_skipped_the_same_micro_batch_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path / "skip", steps=6, interval=2, script={4: "none"})
    events = read_lines(trail(tmp_path / "skip"))
    write_lines(tmp_path / "run" / "logs" / "events.rank0.jsonl", _as_rank(events, 0))
    write_lines(tmp_path / "run" / "logs" / "events.rank1.jsonl", _as_rank(events, 1))
    code, report = audit_json(capsys, tmp_path / "run")
    assert code == 0 and report["problems"] == []


def test_a_rank_with_another_exit_code_disagrees(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    rank1_events = _as_rank(base, 1)
    rank1_events[-1]["code"] = 3
    write_lines(tmp_path / "run" / "logs" / "events.rank0.jsonl", _as_rank(base, 0))
    write_lines(tmp_path / "run" / "logs" / "events.rank1.jsonl", rank1_events)
    code, report = audit_json(capsys, tmp_path / "run")
    assert code == 3 and problems(report) == [("rank_disagreement", "events.rank1.jsonl", len(base))]
    assert report["problems"][0]["message"] == "attempt 0: exit code: rank 0 0, rank 1 3"


def test_a_killed_attempt_is_reported_at_its_last_record_not_as_an_illegal_transition(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL after the checkpoint of step 4 lost the transitions buffered since: a clean prefix."""
    run(tmp_path / "real", steps=6, interval=2, script={5: ValueError("boom")})
    run(tmp_path / "real", steps=6, interval=2)
    events = read_lines(trail(tmp_path / "real"))
    cut = index_of(events, event="checkpoint_saved", saved_step=4) + 1
    restart = index_of(events, event="run_start", attempt=1)
    events[cut:restart] = []
    path = write_lines(tmp_path / "events.rank0.jsonl", events)
    code, report = audit_json(capsys, path)
    assert code == 0 and report["problems"] == [] and report["run_problems"] == []  # attempt 1 resumed it
    killed, resumed = report["attempts"]
    assert killed["killed"] and killed["exit"] is None and killed["last_step"] == 4
    assert killed["killed_at"] == [
        {
            "rank": 0, "file": str(path), "line": cut, "state": "CHECKPOINT", "step": 4,
            "ts": events[cut - 1]["ts"], "since_previous": events[cut - 1]["ts"] - events[cut - 2]["ts"],
        }
    ]  # fmt: skip
    assert resumed["resumed_from_step"] == 4 and resumed["exit"]["reason"] == "completed"
    code, out, _ = cli(capsys, "audit", path)
    assert code == 0 and f"exit: none: rank 0 killed at its last record ({path}:{cut}): CHECKPOINT at step 4" in out


# ------------------------------------------------------------------ unreadable input
def test_a_missing_path_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "audit", tmp_path / "nowhere")
    assert code == 2 and out == "" and f"{tmp_path / 'nowhere'}: no such file or directory" in err


def test_a_directory_without_a_trail_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "audit", tmp_path)
    assert code == 2 and "no audit trail here" in err


def test_an_empty_file_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.rank0.jsonl"
    path.touch()
    code, _, err = cli(capsys, "audit", path)
    assert code == 2 and f"{path}: the file is empty" in err


def test_a_run_whose_only_rank_file_is_empty_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty file beside other ranks' events is left out with a note (the audit names the rank
    it has no trail of); a run with no events at all is unreadable."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.rank0.jsonl").touch()
    code, _, err = cli(capsys, "audit", tmp_path)
    assert code == 2 and "events.rank0.jsonl: the file is empty" in err


def test_a_line_that_is_not_json_is_unreadable(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "events.rank0.jsonl", base)
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(4, "this is not json\n")
    path.write_text("".join(lines))
    code, out, err = cli(capsys, "audit", path)
    assert code == 2 and out == ""
    assert f"{path}:5: not JSON: 'this is not json'" in err


def test_a_json_line_that_is_not_an_event_is_unreadable(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "events.rank0.jsonl", [*base[:3], {"hello": 1}, *base[3:]])
    code, _, err = cli(capsys, "audit", path)
    assert code == 2 and f"{path}:4: not an audit event" in err


def test_an_unknown_format_version_is_unreadable(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    base[0]["format"] = 99
    path = write_lines(tmp_path / "events.rank0.jsonl", base)
    code, _, err = cli(capsys, "audit", path)
    assert code == 2 and f"{path}:1: events of format 99; this trainfsm reads formats 1, 2, 3, 4 (it writes 4;" in err


def test_a_cut_off_last_line_is_noted_and_tolerated(
    tmp_path: Path, base: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "events.rank0.jsonl", base)
    with open(path, "a") as f:
        f.write(json.dumps(base[4])[:40])  # a killed writer's half line, no newline
    code, report = audit_json(capsys, path)
    assert code == 0 and report["consistent"]
    assert [(n["file"], n["line"]) for n in report["notes"]] == [(str(path), len(base) + 1)]
    assert "cut off" in report["notes"][0]["message"]
    code, out, _ = cli(capsys, "audit", path)
    assert code == 0 and f"{path}:{len(base) + 1}: the last line is cut off" in out


def test_a_cut_off_line_followed_by_a_restart_is_tolerated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real restart appends its run_start right after the half line a killed writer left."""
    run(tmp_path, steps=4, interval=2)
    path = trail(tmp_path)
    cut_line = len(path.read_text().splitlines()) + 1
    with open(path, "a") as f:
        f.write('{"rank":0,"run_id":"x","attempt":0,"ts":1.5,"step":4,"sta')
    run(tmp_path, steps=6, interval=2)
    code, report = audit_json(capsys, tmp_path)
    assert code == 0, report["problems"]
    assert [(n["line"], "run_start" in n["message"]) for n in report["notes"]] == [(cut_line, True)]
    assert [a["start"] for a in report["attempts"]] == ["launch", "resume"]


def test_the_console_script_runs_audit(tmp_path: Path) -> None:
    run(tmp_path, steps=2, interval=1)
    script = Path(sys.executable).with_name("trainfsm")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "trainfsm"]
    result = subprocess.run([*argv, "audit", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "consistent" in result.stdout


@pytest.mark.parametrize("command", ["audit", "trace", "plot", "inspect"])
def test_every_command_documents_its_exit_codes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli(capsys, command, "--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: trainfsm {command}" in out
    assert "exit codes:" in out and "\n  0  " in out and "\n  2  " in out
    if command in ("audit", "trace"):
        assert "\n  1  the trail is consistent, but the run did not end well" in out
        assert "\n  3  the trail is inconsistent with the machine" in out


def test_the_main_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(capsys, "--help")
    out = capsys.readouterr().out
    assert "\n  1    failure: the run failed or did not end well" in out
    assert "\n  3    audit, trace: the trail is inconsistent" in out and "\n  130  interrupted" in out


def test_every_problem_kind_is_documented() -> None:
    import trainfsm.tools.audit

    for kind in (*PROBLEM_KINDS, *RUN_PROBLEM_KINDS):
        assert f"``{kind}``" in (trainfsm.tools.audit.__doc__ or "")
