"""The data ledger (issue 34): the trail proves that a resumed run trained every batch exactly once,
and names the attempt and positions where it did not. Each launch is an attempt of
``tests/faults/ledger_breaks.py``, one that is SIGKILLed in a real process of its own; breaks are
planted on purpose, each in its own test, and a run without one is the guard that the checks can pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.faults import ledger_breaks
from tests.helpers import read_events
from trainfsm.tools import audit
from trainfsm.tools.ledger import saved_position
from trainfsm.trail.schema import FORMAT_VERSION

SCRIPT = Path(ledger_breaks.__file__)


def launch(workspace: Path, *args: str, expect: int = 0) -> None:
    """One attempt of the script. One that must die of its SIGKILL runs in a process of its own; the
    others run here (a new ``train()`` is a new attempt all the same), sparing torch's import."""
    if expect == 0:
        ledger_breaks.main([str(workspace), *args])
        return
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(workspace), *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == expect, done.stderr[-3000:]


def run_cli_audit(workspace: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainfsm", "audit", str(workspace)], capture_output=True, text=True, timeout=60
    )


def ledger_breaks_of(workspace: Path) -> list[Any]:
    return [p for p in audit.audit([workspace]).run_problems if p.kind == "ledger"]


def killed_then_resumed(workspace: Path, *args: str) -> None:
    """Attempt 0 saves at 4 and 8 and is SIGKILLed in step 10; attempt 1 resumes and completes 12."""
    launch(workspace, "--kill-at", "10", *args, expect=-9)
    launch(workspace, *args)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed in step 10 and resumed, with nothing planted (read-only: copy it to edit)."""
    workspace = tmp_path_factory.mktemp("clean")
    killed_then_resumed(workspace)
    return workspace


# ---------------------------------------------------------------- the guard: a run without a break
@pytest.mark.parametrize("loader", ["list", "stateful"])
def test_a_killed_and_resumed_run_draws_each_batch_once_and_the_ledger_says_so(
    tmp_path: Path, loader: str, clean: Path
) -> None:
    if loader == "list":
        tmp_path = clean
    else:
        killed_then_resumed(tmp_path, "--loader", loader)
    report = audit.audit([tmp_path])
    assert report.run_problems == [] and report.problems == []
    (line,) = report.ledger
    # Attempt 0's trail ends at its last flush: the first batch after the save (step 9's, whose
    # fingerprint is written at once); the rest of steps 9 and 10 died with it.
    assert line == (
        "rank 0: attempt 0: epoch 0 batch 0 -> epoch 0 batch 8, saved at step 8 (drew on to epoch 0 batch 9: "
        "not kept) (steps 1-8); attempt 1: epoch 0 batch 8 -> epoch 1 batch 2 (steps 9-12): each batch drawn once"
    )
    done = run_cli_audit(tmp_path)
    assert done.returncode == 0 and "\ndata ledger: rank 0: attempt 0: " in done.stdout


def test_the_trail_records_the_positions_saved_and_restored(clean: Path) -> None:
    events = read_events(clean)
    saved = {e["saved_step"]: e for e in events if e["event"] == "checkpoint_saved"}
    assert [saved_position(saved[step]["data"], 0) for step in (4, 8, 12)] == [(0, 4), (0, 8), (1, 2)]
    (resumed,) = [e for e in events if e["event"] == "data_resumed"]
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert (resumed["from_step"], resumed["epoch"], resumed["batches"]) == (8, 0, 8)
    assert loaded["checksum"] == saved[8]["checksum"]  # the resume names the save it came from
    fingerprints = [(e["after"], e["from_step"], e["batches"]) for e in events if e["event"] == "batch_fingerprint"]
    # The final save's batch after it is drawn at exit, so a resume from it is checked too.
    assert fingerprints == [("save", 4, 5), ("save", 8, 9), ("resume", 8, 9), ("save", 12, 3)]


# ---------------------------------------------------------------- planted breaks
def test_a_launch_whose_checkpoints_were_deleted_starts_from_scratch_and_the_ledger_says_what_is_trained_again(
    tmp_path: Path,
) -> None:
    launch(tmp_path, "--steps", "8")
    shutil.rmtree(tmp_path / "checkpoints")
    launch(tmp_path, "--steps", "12")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message == (
        f"rank 0, attempt 1 started from scratch (step 0, epoch 0 batch 0) although attempt 0 saved checkpoint 8 "
        f"completely ({tmp_path / 'checkpoints' / '8'}): the batches up to epoch 0 batch 8 are trained again "
        f"(pass CheckpointingHook(load=None) to start afresh on purpose)"
    )
    done = run_cli_audit(tmp_path)
    assert done.returncode == 1 and "[ledger] rank 0, attempt 1 started from scratch" in done.stdout


def test_a_fresh_start_asked_for_with_load_none_is_not_a_break(tmp_path: Path) -> None:
    launch(tmp_path, "--steps", "8")
    launch(tmp_path, "--steps", "4", "--load", "none")
    assert ledger_breaks_of(tmp_path) == []


def test_a_resume_that_restores_another_checkpoints_data_position_is_caught_with_both_positions(
    tmp_path: Path,
) -> None:
    killed_then_resumed(tmp_path, "--plant", "other-position:4")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message == (
        "rank 0, attempt 1 resumed from checkpoint 8 (saved by attempt 0) at epoch 0 batch 4, but that checkpoint "
        "saved epoch 0 batch 8 for it: the batches between are drawn twice"
    )
    assert (problem.rank, problem.attempt) == (0, 1)
    assert run_cli_audit(tmp_path).returncode == 1


def test_a_loader_that_skips_a_batch_on_resume_is_caught_by_the_batch_it_draws_first(tmp_path: Path) -> None:
    killed_then_resumed(tmp_path, "--loader", "skipping")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message.startswith(
        "rank 0, attempt 1: the first batch after resuming from checkpoint 8 is not the batch attempt 0 drew after "
        "saving it (epoch 0 batch 9; fingerprint "
    )
    assert problem.message.endswith("the data loader did not resume where it said it did")
    assert run_cli_audit(tmp_path).returncode == 1


# ---------------------------------------------------------------- old trails
def test_an_old_trail_without_ledger_fields_audits_and_says_the_ledger_is_not_checked(
    tmp_path: Path, clean: Path
) -> None:
    shutil.copytree(clean / "logs", tmp_path / "logs")
    trail = tmp_path / "logs" / "events.rank0.jsonl"
    old = [
        line.replace(f'"format":{FORMAT_VERSION}', '"format":2')
        for line in trail.read_text().splitlines()
        if '"batch_fingerprint"' not in line
    ]
    trail.write_text("\n".join(old) + "\n")
    report = audit.audit([tmp_path])
    assert report.problems == [] and report.run_problems == []
    assert [n.message for n in report.notes] == [
        "attempt 0: the data ledger is not checked: its trail (format 2) has no data ledger: written by an older "
        "trainfsm",
        "attempt 1: the data ledger is not checked: its trail (format 2) has no data ledger: written by an older "
        "trainfsm",
    ]
    assert report.ledger == ["rank 0: attempt 0: not checked; attempt 1: not checked: each batch drawn once"]


def test_an_older_checkpoint_copied_under_a_newer_name_is_refused_and_the_ledger_names_the_save_used(
    tmp_path: Path,
) -> None:
    launch(tmp_path, "--kill-at", "10", expect=-9)
    shutil.rmtree(tmp_path / "checkpoints" / "8")
    shutil.copytree(tmp_path / "checkpoints" / "4", tmp_path / "checkpoints" / "8")  # step 4's files, named 8
    launch(tmp_path)
    events = read_events(tmp_path)
    assert [e["path"] for e in events if e["event"] == "checkpoint_skipped"] == [str(tmp_path / "checkpoints" / "8")]
    report = audit.audit([tmp_path])
    assert ledger_breaks_of(tmp_path) == []
    (line,) = report.ledger
    assert line.startswith(
        "rank 0: attempt 0: epoch 0 batch 0 -> epoch 0 batch 4, saved at step 4 (drew on to epoch 0 batch 9: not kept) "
        "(steps 1-8); attempt 1: epoch 0 batch 4 -> "
    )
    assert line.endswith(": each batch drawn once")
