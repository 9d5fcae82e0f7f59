"""The data ledger as a second reviewer of issue 49 found it: each test is a finding (it failed
before its fix), now the behaviour that holds. The trails are the real ones of
``tests/test_ledger_sizes.py`` (``tests/faults/reshard_trails.py``), edited where a case needs it,
or runs of ``tests/distributed/reshard_worker.py`` made here. Three more real trails of that worker
(ranks as processes of their own, ``tests.distributed.launch.Ranks``, ``--self-signal``; the workspace
replaced by ``runs/reshard``) are checked in under ``tests/data/reshard``:

- ``rebatched``: 2 ranks ``--preempt-at 2``, then 2 ranks ``--batch 1``, by trainfsm before the fix of
  a resume with another per-rank batch size (each rank resumed at its own count);
- ``same_size``: 2 ranks ``--preempt-at 2``, then 2 ranks;
- ``abandoned``: 4 ranks ``--preempt-at 2``; 2 ranks ``--micro-seconds 0.3`` killed (SIGKILL) after
  9 s, before any save; 3 ranks to the end (from checkpoint 3 again)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_data_order import layout, saved
from tests.test_data_reshard import assert_each_sample_once, in_process, resumed
from tests.test_ledger_sizes import CLEAN, DATA, cli_audit, edited, ledger_problems
from trainfsm import data_order
from trainfsm.tools import audit
from trainfsm.tools.ledger import proven


def without_rank(tmp_path: Path, rank: int) -> Path:
    """The clean run (4 → 2 → 3 ranks) with one rank's trail file missing."""
    shutil.copytree(CLEAN / "logs", tmp_path / "logs")
    (tmp_path / "logs" / f"events.rank{rank}.jsonl").unlink()
    return tmp_path


# ---------------------------------------------------------------- a rank's trail is missing
def test_a_missing_ranks_trail_across_world_sizes_cannot_be_checked_not_never_trained(tmp_path: Path) -> None:
    """Rank 3 existed only in attempt 0 (4 ranks); its file is gone. Its positions (p % 4 == 3) were
    trained, by a rank the ledger cannot see: not "18 positions never trained" (exit 1)."""
    report = audit.audit([without_rank(tmp_path, 3)])
    cannot = "attempt 0 on 4 ranks: the trail has no record of rank 3; which samples it drew is unknown"
    assert ledger_problems(report) == []
    assert report.ledger == [f"all ranks, world size 4 → 2 → 3: cannot be checked: {cannot}"]
    assert f"the data ledger cannot be checked across world size 4 → 2 → 3: {cannot}" in [
        n.message for n in report.notes
    ]
    assert cli_audit(tmp_path).returncode == 0


def test_a_rank_missing_from_two_attempts_is_named_at_the_first(tmp_path: Path) -> None:
    report = audit.audit([without_rank(tmp_path, 2)])
    (line,) = report.ledger
    assert line == (
        "all ranks, world size 4 → 2 → 3: cannot be checked: attempt 0 on 4 ranks: the trail has no record of "
        "rank 2; which samples it drew is unknown"
    )
    assert not proven(line) and ledger_problems(report) == []


def test_a_ranks_trail_that_ends_before_its_data_was_positioned_while_its_peers_trained_cannot_be_checked(
    tmp_path: Path,
) -> None:
    """Rank 1's trail of attempt 1 (2 ranks) ends at its restore (its last lines never reached the
    disk); rank 0 trained and saved checkpoint 7, which attempt 2 resumed. What rank 1 drew is
    unknown, not never trained."""

    def cut(event: dict[str, Any]) -> dict[str, Any] | None:
        late = event["rank"] == 1 and event["attempt"] == 1 and event["event"] != "run_start"
        return None if late and event["ts"] >= restored_at else event

    restore = next(
        json.loads(line)
        for line in (CLEAN / "logs" / "events.rank1.jsonl").read_text().splitlines()
        if '"event":"data_resumed"' in line and '"attempt":1' in line
    )
    restored_at = restore["ts"]
    report = audit.audit([edited(tmp_path, cut)])
    assert ledger_problems(report) == []
    assert report.ledger == [
        "all ranks, world size 4 → 2 → 3: cannot be checked: attempt 1 on 2 ranks: the trail of rank 1 ends before "
        "its data was positioned; which samples it drew is unknown"
    ]


def test_what_was_checked_does_not_claim_the_positions_were_checked_when_they_could_not_be(tmp_path: Path) -> None:
    checked = audit.audit([without_rank(tmp_path, 3)]).ledger_checked
    assert "their union checked" not in checked
    assert checked.endswith(
        "across world size 4 → 2 → 3: not mapped to positions (cannot be checked: see notes); assumed: the loader "
        "draws its order between fingerprints"
    )


# ---------------------------------------------------------------- another per-rank batch at the same world size
@pytest.mark.slow  # 14 s of runs; the fast tier's 4 -> 2 reshard (tests/test_data_reshard.py) takes the same path
def test_a_resume_with_half_the_per_rank_batch_on_as_many_ranks_trains_each_sample_once_and_the_ledger_proves_it(
    tmp_path: Path,
) -> None:
    """The global batch kept (24), the per-rank batch halved after a preemption (2 → 1, the
    accumulation 6 → 12: the usual answer to running out of memory): the 18 micro-batches each rank
    drew are 72 positions, which the new batches reach at micro-batch 36, not 18. Before: each rank
    skipped 18 of its own, 36 samples of epoch 0 were trained twice and 36 of epoch 1 never, the
    trail said ``global`` 72 and ``exact``, and audit blamed the loader."""
    workspace = tmp_path / "ws"
    assert set(in_process(workspace, 2, "--preempt-at", "2").values()) == {138}
    assert set(in_process(workspace, 2, "--batch", "1").values()) == {0}
    assert_each_sample_once(workspace)
    (resume,) = resumed(workspace)
    assert (resume["batches"], resume["global"], resume["exact"]) == (36, {"epoch": 0, "samples": 72}, True)
    report = audit.audit([workspace])
    assert ledger_problems(report) == []
    (line,) = report.ledger
    assert line.startswith(
        "all ranks, world size 2, per-rank batch 2 → 1: attempt 0 on 2 ranks with batches of 2 kept epoch 0 positions "
        "0-71 (epoch 0 micro-batches 0-17 of each rank; steps 1-3, saved in checkpoint 3); attempt 1 on 2 ranks with "
        "batches of 1 resumed checkpoint 3 and kept epoch 0 positions 72-95 and epoch 1 positions 0-95 (epoch 0 "
        "micro-batches 36-47 and epoch 1 micro-batches 0-47 of each rank; steps 4-8)"
    )
    assert proven(line)


def test_a_resume_that_kept_the_micro_batch_count_when_the_batch_halved_is_caught_with_the_samples_trained_twice() -> (
    None
):
    """``tests/data/reshard/rebatched``: the same run recorded by trainfsm before the fix (each rank
    resumed at its own micro-batch 18 with batches of 1: position 36, not 72). Before, the ledger
    compared counts as at one world size and blamed the loader ("did not resume where it said")."""
    report = audit.audit([DATA / "rebatched"])
    assert ledger_problems(report) == [
        "attempt 1 on 2 ranks says it continued checkpoint 3's position 72 of epoch 0 (data_resumed.global), but "
        "ranks 0-1 counted from micro-batch 18 of epoch 0, which is position 36 at 2 ranks with batches of 1: the "
        "ranks did not skip to the global position",
        "world size 2, per-rank batch 2 → 1, epoch 0: 36 positions of its order trained twice, from position 36 to 71 "
        "(position 36: attempt 0 rank 0 and attempt 1 rank 0); the dataset's samples 98, 23, 20, 29, 78 and 31 more",
    ]
    assert report.ledger_checked.endswith(
        "assumed: the loader draws its order between fingerprints; on another world size or per-rank batch (no "
        "fingerprint pairs there), that the loader skipped to its count"
    )


def test_at_one_world_size_a_rank_whose_trail_is_missing_has_a_line_that_says_it_was_not_checked(
    tmp_path: Path,
) -> None:
    """``tests/data/reshard/same_size``: 2 ranks preempted in step 3 and resumed on 2. Without rank 1's
    file the only line was rank 0's, "each micro-batch kept once", as if it spoke for the run."""
    shutil.copytree(DATA / "same_size" / "logs", tmp_path / "logs")
    assert audit.audit([tmp_path]).ledger[0].endswith(": each micro-batch kept once, none skipped")
    (tmp_path / "logs" / "events.rank1.jsonl").unlink()
    report = audit.audit([tmp_path])
    assert report.ledger[1:] == [
        "rank 1: attempt 0: not checked (the trail has no record of this rank); attempt 1: not checked (the trail "
        "has no record of this rank): not proven: attempt 0, 1 not checked (see notes)"
    ]
    assert not proven(report.ledger[1]) and ledger_problems(report) == []


# ---------------------------------------------------------------- a killed last attempt on another world size
def killed_in_step_8() -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """An edit: attempt 2 (3 ranks) SIGKILLed in step 8, before its save. Each rank's trail ends at
    its last flush: rank 2's after 2 of the step's 4 micro-batches, ranks 0-1's after all 4."""
    drawn: dict[int, int] = {}
    cut: set[int] = set()

    def edit(event: dict[str, Any]) -> dict[str, Any] | None:
        rank = event["rank"]
        if event["attempt"] != 2 or rank in cut:
            return None if rank in cut and event["attempt"] == 2 else event
        if event["event"] == "transition" and event["dest"] != "RESTORE" and event["source"] != "RESTORE":
            drawn[rank] = drawn.get(rank, 0) + (event["dest"] == "ACCUMULATE")
            if drawn[rank] > (2 if rank == 2 else 4) or event["dest"] == "CHECKPOINT":
                cut.add(rank)
                return None
        return event

    return edit


def test_a_killed_last_attempt_whose_ranks_trails_end_apart_is_not_a_gap_at_the_epochs_end(tmp_path: Path) -> None:
    """Before: "[ledger] epoch 1: 4 positions of its order never trained, from position 86 to 95 (the
    epoch's end)", beside the kill: rank 2's last draws were never written, not never trained."""
    report = audit.audit([edited(tmp_path, killed_in_step_8())])
    assert ledger_problems(report) == []
    assert [p.kind for p in report.run_problems] == ["killed"]
    assert (
        "attempt 2 was killed and its ranks' trails end at different micro-batches (each where it was last "
        "written): epoch 1 is checked up to position 83; what its ranks drew after that is not known"
    ) in [n.message for n in report.notes]
    (line,) = report.ledger
    assert "attempt 2 on 3 ranks resumed checkpoint 7 and kept epoch 1 positions 72-83 (ranks 0-1: epoch 1 " in line


# ---------------------------------------------------------------- the trainer's words where it refuses
def test_a_padded_order_is_refused_for_its_padding_not_for_epochs_that_end_differently() -> None:
    """98 samples pad to 100 positions at 4 ranks and at 5 (batches of 1, no global_batch_size):
    a real run refused with "an epoch trains 100 positions of its order at world size 4 and 100 at 5
    (of 98 samples): the epochs end differently", which they do not."""
    old = [saved((0, 5), layout(98, 4, r, 1, None)) for r in range(4)]
    found = data_order.continue_at(old, layout(98, 5, 0, 1, None))
    assert not found.exact
    assert found.reason == (
        "DistributedSampler pads each epoch's order of 98 samples to 100 positions (at world size 4 and at 5), "
        "repeating 2 of its samples: an epoch trains those twice at any size (state global_batch_size so that each "
        "epoch ends at its last full global batch)"
    )


# ---------------------------------------------------------------- a save whose event was never written
def save_unlogged(restarted: bool = False) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """An edit of ``same_size``: attempt 0 killed once checkpoint 3 was durable, before its
    ``checkpoint_saved`` was written (an asynchronous save is logged at the next step's start). With
    ``restarted``, attempt 1's loader began the epoch again (a ``load_state_dict`` that does nothing):
    its first draw is the one attempt 0 drew first in epoch 0."""
    first: dict[int, str] = {}

    def edit(event: dict[str, Any]) -> dict[str, Any] | None:
        if event["attempt"] == 0:
            if event["event"] == "epoch" and event["epoch"] == 0:
                first[event["rank"]] = event["fingerprint"]
            gone = event["event"] in ("checkpoint_saved", "checkpoint_pruned", "exit")
            return None if gone or (event["event"] == "transition" and event["dest"] == "EXIT") else event
        if restarted and event["event"] == "batch_fingerprint" and event["after"] == "resume":
            return {**event, "fingerprint": first[event["rank"]]}
        return event

    return edit


def test_a_resume_from_a_save_whose_event_was_lost_is_checked_against_the_counts_at_that_checkpoint(
    tmp_path: Path,
) -> None:
    """Before: "attempt 0 drew epoch 0 micro-batches 0-17, not kept: no later attempt resumed from its
    checkpoints", the resume's position "taken as given", no fingerprint paired."""
    report = audit.audit([edited(tmp_path, save_unlogged(), DATA / "same_size")])
    assert report.ledger == [
        "ranks 0-1: attempt 0 kept epoch 0 micro-batches 0-17 (steps 1-3, saved in checkpoint 3); attempt 1 resumed "
        "checkpoint 3 and kept epoch 0 micro-batches 18-23 and epoch 1 micro-batches 0-23 (steps 4-8): each "
        "micro-batch kept once, none skipped"
    ]
    assert "2 fingerprint pairs compared, all equal" in report.ledger_checked
    assert (
        "attempt 1: resumed from checkpoint 3 (runs/reshard/checkpoints/3), whose checkpoint_saved attempt 0 never "
        "wrote (killed before logging it, as after an asynchronous save): its position is taken from what attempt "
        "0's ranks counted entering CHECKPOINT at step 3"
    ) in [n.message for n in report.notes]


def test_a_loader_that_restarted_the_epoch_after_such_a_resume_is_caught_not_certified(tmp_path: Path) -> None:
    """Before: "each micro-batch kept once, none skipped", while micro-batches 0-17 were trained twice."""
    report = audit.audit([edited(tmp_path, save_unlogged(restarted=True), DATA / "same_size")])
    assert ledger_problems(report)[0] == (
        "rank 0, attempt 1 resumed at epoch 0 micro-batch 0 (the micro-batch it drew first is the one attempt 0 drew "
        "first in epoch 0), not at micro-batch 18 of epoch 0 as checkpoint 3 saved: micro-batches 0-17 of epoch 0 "
        "trained twice"
    )
    assert not any(proven(line) for line in report.ledger)


def test_a_trail_that_begins_with_a_resume_says_under_assumed_that_the_position_was_taken_as_given(
    tmp_path: Path,
) -> None:
    """Attempt 0's records gone (another run's checkpoint, or a trail kept from attempt 1 on): the
    resume's position is not checked. Before, only a note said so; ``checked`` listed nothing assumed
    beyond the loader."""
    report = audit.audit([edited(tmp_path, lambda e: None if e["attempt"] == 0 else e, DATA / "same_size")])
    assert report.ledger_checked.endswith(
        "assumed: the loader draws its order between fingerprints; that checkpoint 3, which no attempt of this trail "
        "saved, holds the data position attempt 1 resumed"
    )


# ---------------------------------------------------------------- an attempt off the lineage on another size
def test_an_attempt_nobody_resumed_is_in_the_line_across_world_sizes_with_what_it_drew(tmp_path: Path) -> None:
    """``tests/data/reshard/abandoned``: preempted at 4 ranks (checkpoint 3), resumed at 2 and killed
    in step 5 before any save, resumed from checkpoint 3 again at 3 ranks to the end. Before, the line
    ("world size 4 → 3") left attempt 1 out: a run on 2 ranks that the ledger never mentioned."""
    (line,) = audit.audit([DATA / "abandoned"]).ledger
    assert (
        "; attempt 1 on 2 ranks resumed checkpoint 3 and drew epoch 0 micro-batches 18-23 of each rank (step 4; at "
        "least: their trails end there), not kept: it saved no checkpoint; attempt 2 on 3 ranks resumed checkpoint 3 "
        "and kept epoch 0 positions 72-95 and epoch 1 positions 0-95 "
    ) in line
    assert line.startswith("all ranks, world size 4 → 3: attempt 0 on 4 ranks kept") and proven(line)


# ---------------------------------------------------------------- a rank file left empty
def test_a_rank_file_left_empty_by_a_kill_before_its_first_write_does_not_stop_the_audit(tmp_path: Path) -> None:
    """The writer creates its file at start and writes at its first flush: a rank killed in between
    (or a full disk) leaves 0 bytes. Today: "trainfsm audit: error: ...events.rank3.jsonl: the file is
    empty (no events)", exit 2, for the whole run."""
    workspace = without_rank(tmp_path, 3)
    (workspace / "logs" / "events.rank3.jsonl").write_text("")
    done = cli_audit(workspace)
    assert done.returncode == 0, done.stderr
    assert "cannot be checked: attempt 0 on 4 ranks: the trail has no record of rank 3" in done.stdout
