"""The data ledger (issues 34 and 49) at one world size: the trail proves that a resumed run kept
every micro-batch exactly once, names the attempt and micro-batches where it did not, and says what
it proved and what it assumed. Each launch is an attempt of ``tests/faults/ledger_breaks.py``: one
that is SIGKILLed runs in a real process of its own, the others here (a preempted one leaves by
SystemExit 138, as ``train()`` does). Breaks are planted on purpose, each in its own test, and a run
without one is the guard that the checks can pass. Across world sizes: ``tests/test_ledger_sizes.py``."""

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
from trainfsm.tools.ledger import ONCE, saved_position
from trainfsm.trail.schema import FORMAT_VERSION

SCRIPT = Path(ledger_breaks.__file__)
COUNTED = "micro-batches counted on each rank from its trail (each draw, epoch, save and resume)"
ASSUMED = "assumed: the loader draws its order between fingerprints"


def launch(workspace: Path, *args: str, expect: int = 0) -> None:
    """One attempt of the script. One that must die of its SIGKILL runs in a process of its own; the
    others run here (a new ``train()`` is a new attempt all the same), sparing torch's import."""
    if expect == 0:
        ledger_breaks.main([str(workspace), *args])
        return
    if expect == 138:  # preempted: the trainer saved, then left by SystemExit
        with pytest.raises(SystemExit) as info:
            ledger_breaks.main([str(workspace), *args])
        assert info.value.code == expect
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


def preempted_then_resumed(workspace: Path, *args: str) -> None:
    """Attempt 0 takes SIGUSR1 in step 3, saves checkpoint 3 and exits 138; attempt 1 resumes to 12."""
    launch(workspace, "--signal-at", "3", *args, expect=138)
    launch(workspace, *args)


def older_checkpoint_resumed(workspace: Path, *args: str) -> None:
    """Attempt 0 completes 12 steps (saves 4, 8, 12); checkpoint 12 is lost; attempt 1 resumes from
    8 and draws again what attempt 0 drew after it, epoch 1's first micro-batches included."""
    launch(workspace, *args)
    shutil.rmtree(workspace / "checkpoints" / "12")
    launch(workspace, *args)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed in step 10 and resumed, with nothing planted (read-only: copy it to edit)."""
    workspace = tmp_path_factory.mktemp("clean")
    killed_then_resumed(workspace)
    return workspace


# ---------------------------------------------------------------- the guard: a run without a break
@pytest.mark.parametrize("loader", ["list", "stateful"])
def test_a_killed_and_resumed_run_keeps_each_micro_batch_once_and_the_ledger_says_so(
    tmp_path: Path, loader: str, clean: Path
) -> None:
    if loader == "list":
        tmp_path = clean
    else:
        killed_then_resumed(tmp_path, "--loader", loader)
    report = audit.audit([tmp_path])
    assert report.run_problems == [] and report.problems == []
    (line,) = report.ledger
    # Attempt 0's trail ends at its last flush: the first micro-batch after the save (step 9's, whose
    # fingerprint is written at once); the rest of steps 9 and 10 died with it, hence "at least".
    assert line == (
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-7 (steps 1-8, saved in checkpoint 8), then drew epoch 0 "
        "micro-batch 8 (at least: its trail ends there), not kept; attempt 1 resumed checkpoint 8 and kept epoch 0 "
        "micro-batches 8-9 and epoch 1 micro-batches 0-1 (steps 9-12): each micro-batch kept once, none skipped"
    )
    done = run_cli_audit(tmp_path)
    assert done.returncode == 0 and "\ndata ledger: rank 0: attempt 0 kept " in done.stdout
    assert f"\n  checked: {COUNTED}; " in done.stdout


def test_the_ledger_says_what_it_proved_how_and_what_it_assumed(clean: Path) -> None:
    assert audit.audit([clean]).ledger_checked == f"{COUNTED}; 1 fingerprint pair compared, all equal; {ASSUMED}"


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


def test_every_pair_of_fingerprints_at_one_position_is_compared_across_a_resume(tmp_path: Path) -> None:
    """Resumed from checkpoint 8 after attempt 0 ran on to 12: the micro-batch after save 8, epoch
    1's first, and the one after save 12 were each drawn by both attempts."""
    older_checkpoint_resumed(tmp_path)
    report = audit.audit([tmp_path])
    assert report.run_problems == []
    assert report.ledger_checked == f"{COUNTED}; 3 fingerprint pairs compared, all equal; {ASSUMED}"
    (line,) = report.ledger
    assert line.startswith(
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-7 (steps 1-8, saved in checkpoint 8), then drew epoch 0 "
        "micro-batches 8-9 and epoch 1 micro-batches 0-1, not kept; attempt 1 resumed checkpoint 8 and kept "
    )


# ---------------------------------------------------------------- the words
def test_micro_batches_drawn_and_not_trained_are_named_with_their_steps(tmp_path: Path) -> None:
    """Step 6's first micro-batch returns loss=None; step 9's first try has non-finite gradients and
    runs again on the next micro-batch (epoch 1's first)."""
    launch(tmp_path, "--loss-none-at", "6", "--non-finite-at", "9")
    (line,) = audit.audit([tmp_path]).ledger
    assert line == (
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-9 and epoch 1 micro-batches 0-3 (steps 1-12), of which not "
        "trained: epoch 0 micro-batch 5 at step 6 (loss=None); epoch 0 micro-batch 9 at step 9 (non-finite gradients: "
        f"the step ran again on the next micro-batches): {ONCE}"
    )


def test_steps_the_fp16_scaler_skipped_are_named_the_first_few_then_counted(tmp_path: Path) -> None:
    launch(tmp_path, "--fp16", "--non-finite-at", "2,3,5,7")
    (line,) = audit.audit([tmp_path]).ledger
    assert line == (
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-9 and epoch 1 micro-batches 0-1 (steps 1-12), of which not "
        "trained: epoch 0 micro-batch 1 at step 2, epoch 0 micro-batch 2 at step 3, epoch 0 micro-batch 4 at step 5 "
        f"and 1 more (the fp16 grad scaler skipped the step): {ONCE}"
    )


def test_micro_batches_of_a_step_the_data_ran_out_in_are_named_as_not_trained(tmp_path: Path) -> None:
    """Two epochs of 10 micro-batches, 3 a step: step 7 draws the last 2 and finds no third."""
    launch(tmp_path, "--accumulation", "3", "--max-epochs", "2", "--steps", "100")
    (line,) = audit.audit([tmp_path]).ledger
    assert line == (
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-9 and epoch 1 micro-batches 0-9 (steps 1-6), of which not "
        "trained: epoch 1 micro-batches 8-9 at step 7 (the data ran out (max_epochs) before the step's last "
        f"micro-batch): {ONCE}"
    )


def test_a_completed_runs_launch_again_says_nothing_was_left_to_draw_not_that_nothing_was_saved(tmp_path: Path) -> None:
    launch(tmp_path)
    launch(tmp_path)  # resumes checkpoint 12 at max_steps and leaves at once
    report = audit.audit([tmp_path])
    assert report.notes == [] and report.run_problems == []
    assert report.ledger == [
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-9 and epoch 1 micro-batches 0-1 (steps 1-12, saved in "
        "checkpoint 12); attempt 1 resumed checkpoint 12 at max_steps: nothing left to draw: "
        f"{ONCE}"
    ]


def test_an_attempt_that_ended_while_restore_positioned_its_data_drew_nothing_and_is_not_unchecked(
    tmp_path: Path,
) -> None:
    """Between ``restore`` and ``data_resumed`` (its loader failed there; a kill there is the same):
    no position was restored because none was drawn, not because the checkpoint had none."""
    launch(tmp_path, "--steps", "8")
    with pytest.raises(RuntimeError, match="planted: --fail-in-restore"):
        launch(tmp_path, "--fail-in-restore")
    launch(tmp_path)
    report = audit.audit([tmp_path])
    assert report.notes == [] and report.run_problems == []
    assert report.ledger == [
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-7 (steps 1-8, saved in checkpoint 8); attempt 1 ended before "
        "its data was positioned: drew nothing; attempt 2 resumed checkpoint 8 and kept epoch 0 micro-batches 8-9 and "
        f"epoch 1 micro-batches 0-1 (steps 9-12): {ONCE}"
    ]


def test_an_attempt_no_later_attempt_resumed_from_kept_nothing(tmp_path: Path) -> None:
    """Attempt 1 resumes checkpoint 8 and fails in step 11 before its next save; attempt 2 resumes
    checkpoint 8 again: the run's weights come from attempts 0 and 2 (the lineage), not 1."""
    launch(tmp_path, "--steps", "8")
    with pytest.raises(RuntimeError, match="planted: --fail-at 11"):
        launch(tmp_path, "--fail-at", "11")
    launch(tmp_path)
    (line,) = audit.audit([tmp_path]).ledger
    assert line == (
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-7 (steps 1-8, saved in checkpoint 8); attempt 1 resumed "
        "checkpoint 8 and drew epoch 0 micro-batches 8-9 and epoch 1 micro-batch 0 (steps 9-10), not kept: no later "
        "attempt resumed from its checkpoints; attempt 2 resumed checkpoint 8 and kept epoch 0 micro-batches 8-9 and "
        f"epoch 1 micro-batches 0-1 (steps 9-12): {ONCE}"
    )


# ---------------------------------------------------------------- planted breaks
def test_a_loader_whose_load_state_dict_does_nothing_preempted_and_resumed_is_named_with_what_it_trained_twice(
    tmp_path: Path,
) -> None:
    """Preempted by a signal, not killed: the normal requeue path. The loader starts its epoch again
    on resume while the trainer counts on from 3; the fingerprint of the micro-batch after the
    exiting save, and that of epoch 0's first, say so."""
    preempted_then_resumed(tmp_path, "--loader", "forgetful")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message == (
        "rank 0, attempt 1 resumed at epoch 0 micro-batch 0 (the micro-batch it drew first is the one attempt 0 drew "
        "first in epoch 0), not at micro-batch 3 of epoch 0 as checkpoint 3 saved: micro-batches 0-2 of epoch 0 "
        "trained twice"
    )
    done = run_cli_audit(tmp_path)
    assert done.returncode == 1 and "[ledger] rank 0, attempt 1 resumed at epoch 0 micro-batch 0 " in done.stdout


def test_the_same_preempted_run_with_a_loader_that_resumes_keeps_each_micro_batch_once(tmp_path: Path) -> None:
    preempted_then_resumed(tmp_path, "--loader", "stateful")
    report = audit.audit([tmp_path])
    assert report.run_problems == [] and report.ledger[0].endswith(ONCE)
    assert "; 1 fingerprint pair compared, all equal; " in report.ledger_checked


def test_a_loader_that_skips_a_micro_batch_after_a_preemption_is_caught_by_the_micro_batch_it_draws_first(
    tmp_path: Path,
) -> None:
    preempted_then_resumed(tmp_path, "--loader", "skipping")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message.startswith(
        "rank 0, attempt 1: the first micro-batch after resuming from checkpoint 3 is not the one attempt 0 drew after "
        "saving it (epoch 0 micro-batch 3; fingerprint "
    )
    assert problem.message.endswith(
        "nor any other micro-batch fingerprinted in this trail: the data loader did not resume where it said it did"
    )


def test_a_loader_that_skips_a_micro_batch_after_a_kill_is_caught_by_the_micro_batch_it_draws_first(
    tmp_path: Path,
) -> None:
    killed_then_resumed(tmp_path, "--loader", "skipping")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message.startswith(
        "rank 0, attempt 1: the first micro-batch after resuming from checkpoint 8 is not the one attempt 0 drew after "
        "saving it (epoch 0 micro-batch 8; fingerprint "
    )
    assert run_cli_audit(tmp_path).returncode == 1


def test_a_loader_that_skips_the_last_micro_batch_of_an_epoch_is_named_though_its_count_moved_on(
    tmp_path: Path,
) -> None:
    """Saved before epoch 0's last micro-batch (9 of 10): the loader lands past it and ends the epoch
    at once, so the trainer counts the first draw as epoch 1's. It is compared with the micro-batch
    the saving run drew after that save all the same (CI once met this at a deadline's save)."""
    preempted_then_resumed(tmp_path, "--signal-at", "9", "--loader", "skipping")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message.startswith(
        "rank 0, attempt 1: after resuming from checkpoint 9 the data loader ended epoch 0 at once, without drawing "
        "micro-batch 9, which attempt 0 drew after saving it (fingerprint "
    )
    assert problem.message.endswith(
        "epoch 0 from micro-batch 9 on skipped; the loader did not resume where it said it did"
    )


def test_the_same_save_before_an_epochs_last_micro_batch_with_a_loader_that_resumes_is_kept_once(
    tmp_path: Path,
) -> None:
    preempted_then_resumed(tmp_path, "--signal-at", "9", "--loader", "stateful")
    report = audit.audit([tmp_path])
    assert report.run_problems == [] and report.ledger[0].endswith(ONCE)
    assert "; 1 fingerprint pair compared, all equal; " in report.ledger_checked


def test_an_exit_whose_draw_outlasts_its_second_leaves_on_time_and_the_ledger_says_that_resume_is_unchecked(
    tmp_path: Path,
) -> None:
    """The loader takes 3 s to give the micro-batch after the exiting save: EXIT waits
    ``EXIT_DRAW_SECONDS`` (1 s) for it, records that it has none, and goes on; the audit cannot
    compare that resume, says so, and finds nothing wrong."""
    preempted_then_resumed(tmp_path, "--loader", "stalling")
    events = read_events(tmp_path)
    starts = [i for i, e in enumerate(events) if e["event"] == "run_start"]
    first = events[: starts[1]]  # attempt 0's
    saved = next(e for e in first if e["event"] == "checkpoint_saved" and e["saved_step"] == 3)
    [drawn] = [e for e in first if e["event"] == "batch_fingerprint" and e["after"] == "save" and e["from_step"] == 3]
    left = next(e for e in first if e["event"] == "exit")
    assert drawn["fingerprint"] is None and drawn["batches"] is None
    assert 1.0 <= drawn["ts"] - saved["ts"] < 2.5 and left["ts"] - saved["ts"] < 2.5
    report = audit.audit([tmp_path])
    assert report.run_problems == [] and report.ledger[0].endswith(ONCE)
    assert (
        "1 resume not compared: no fingerprint of the micro-batch the saving run drew next (rank 0, attempt 1, "
        "checkpoint 3)" in report.ledger_checked
    )


def test_a_loader_whose_later_epochs_differ_after_a_resume_is_caught_by_that_epochs_first_micro_batch(
    tmp_path: Path,
) -> None:
    older_checkpoint_resumed(tmp_path, "--loader", "drifting")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message.startswith(
        "rank 0, attempt 1: epoch 1 micro-batch 0 is not the one attempt 0 drew there (first in epoch 1; fingerprint "
    )
    assert problem.message.endswith("the data loader's order differs from the run it resumed")


def test_a_launch_whose_checkpoints_were_deleted_starts_from_scratch_and_the_ledger_says_what_is_trained_again(
    tmp_path: Path,
) -> None:
    launch(tmp_path, "--steps", "8")
    shutil.rmtree(tmp_path / "checkpoints")
    launch(tmp_path, "--steps", "12")
    (problem,) = ledger_breaks_of(tmp_path)
    assert problem.message == (
        f"rank 0, attempt 1 started from scratch (step 0, epoch 0 micro-batch 0) although attempt 0 saved checkpoint 8 "
        f"completely ({tmp_path / 'checkpoints' / '8'}): the micro-batches before epoch 0 micro-batch 8 are trained "
        f"again (pass CheckpointingHook(load=None) to start afresh on purpose)"
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
        "rank 0, attempt 1 resumed from checkpoint 8 (saved by attempt 0) at epoch 0 micro-batch 4, but that "
        "checkpoint saved epoch 0 micro-batch 8 as the next: micro-batches 4-7 of epoch 0 trained twice"
    )
    assert (problem.rank, problem.attempt) == (0, 1)
    assert run_cli_audit(tmp_path).returncode == 1


# ---------------------------------------------------------------- what cannot be checked
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
    assert report.ledger == [
        "rank 0: attempt 0: not checked (see notes); attempt 1: not checked (see notes): not proven: attempt 0, 1 not "
        "checked (see notes)"
    ]


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
        "rank 0: attempt 0 kept epoch 0 micro-batches 0-3 (steps 1-4, saved in checkpoint 4), then drew epoch 0 "
        "micro-batches 4-8 (at least: its trail ends there), not kept; attempt 1 resumed checkpoint 4 and kept "
    )
    assert line.endswith(f": {ONCE}")
