"""The data ledger across world sizes (issue 49, item 6): each rank's kept micro-batches mapped to
positions of each epoch's order, their union proven a prefix with no position twice, or the first
position twice or skipped named; what it cannot check said plainly.

The trails are real (``tests/faults/reshard_trails.py`` records them from gloo ranks of
``tests/distributed/reshard_worker.py``: 100 samples, a shuffling ``DistributedSampler``, per-rank
batches of 2, ``global_batch_size=24``): ``clean`` is preempted at 4 ranks, resumed at 2, preempted,
resumed at 3 (every sample of both epochs trained once: the recording run's own record of the indices
each rank trained says so); ``planted`` resumes at 2 with every new rank at old rank 0's own position
(trainfsm before issue 49). Other cases are those trails edited, each the smallest edit that makes
the case."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.faults import reshard_trails
from trainfsm.tools import audit
from trainfsm.tools.ledger import POSITIONS_ONCE, proven

DATA = Path(__file__).parent / "data" / "reshard"
CLEAN = DATA / "clean"
KEPT = (
    "attempt 0 on 4 ranks kept epoch 0 positions 0-71 (epoch 0 micro-batches 0-8 of each rank; steps 1-3, saved in "
    "checkpoint 3); attempt 1 on 2 ranks resumed checkpoint 3 and kept epoch 0 positions 72-95 and epoch 1 positions "
    "0-71 (epoch 0 micro-batches 18-23 and epoch 1 micro-batches 0-17 of each rank; steps 4-7, saved in checkpoint "
    "7); attempt 2 on 3 ranks resumed checkpoint 7 and kept epoch 1 positions 72-95 (epoch 1 micro-batches 12-15 of "
    "each rank; step 8); an epoch trains positions 0-95 of the 100 of its order (whole global batches of 24)"
)


def edited(tmp_path: Path, edit: Callable[[dict[str, Any]], dict[str, Any] | None], source: Path = CLEAN) -> Path:
    """A copy of a recorded run whose events went through ``edit`` (None: the event is dropped)."""
    (tmp_path / "logs").mkdir()
    for trail in sorted((source / "logs").glob("events.rank*.jsonl")):
        events = (edit(json.loads(line)) for line in trail.read_text().splitlines())
        lines = [json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in events if e is not None]
        (tmp_path / "logs" / trail.name).write_text("\n".join(lines) + "\n")
    return tmp_path


def resumed_at(attempt: int, **fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An edit of ``attempt``'s ``data_resumed`` on every rank."""

    def edit(event: dict[str, Any]) -> dict[str, Any]:
        if event["event"] == "data_resumed" and event["attempt"] == attempt:
            return {**event, **fields}
        return event

    return edit


def cli_audit(workspace: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainfsm", "audit", str(workspace)], capture_output=True, text=True, timeout=60
    )


def ledger_problems(report: audit.AuditReport) -> list[str]:
    return [p.message for p in report.run_problems if p.kind == "ledger"]


# ---------------------------------------------------------------- the guard: a run that is exact
def test_a_run_resumed_on_2_then_3_ranks_keeps_each_position_once_and_its_line_names_both_changes() -> None:
    report = audit.audit([CLEAN])
    assert report.run_problems == [] and report.notes == []
    assert report.ledger == [f"all ranks, world size 4 → 2 → 3: {KEPT}: {POSITIONS_ONCE}"]
    done = cli_audit(CLEAN)
    assert (
        done.returncode == 0 and "\ndata ledger: all ranks, world size 4 → 2 → 3: attempt 0 on 4 ranks" in done.stdout
    )


def test_across_world_sizes_the_ledger_says_how_positions_were_proven_and_what_it_assumed() -> None:
    assert audit.audit([CLEAN]).ledger_checked == (
        "micro-batches counted on each rank from its trail (each draw, epoch, save and resume); no fingerprint could "
        "be paired (each resume changed the world size); across world size 4 → 2 → 3: each rank's kept micro-batches "
        "mapped to positions of each epoch's order (rank r of W holds the positions p with p % W == r), their union "
        "checked to be a prefix of each epoch's order with no position twice; assumed: the loader draws its order "
        "between fingerprints; on another world size (no fingerprint pairs there), that the loader skipped to its count"
    )


# ---------------------------------------------------------------- planted breaks
def test_every_new_rank_resuming_old_rank_0s_position_is_caught_naming_the_positions_trained_twice() -> None:
    """At 2 ranks, each new rank continued old rank 0's 9 micro-batches: 9 x 2 x 2 = position 36,
    not 72. The recording run's own record: exactly 36 samples of epoch 0 trained twice."""
    planted = DATA / "planted"
    report = audit.audit([planted])
    assert ledger_problems(report) == [
        "attempt 1 on 2 ranks says it continued checkpoint 3's position 72 of epoch 0 (data_resumed.global), but "
        "ranks 0-1 counted from micro-batch 9 of epoch 0, which is position 36 at 2 ranks with batches of 2: the ranks "
        "did not skip to the global position",
        "world size 4 → 2, epoch 0: 36 positions of its order trained twice, from position 36 to 71 (position 36: "
        "attempt 0 rank 0 and attempt 1 rank 0); the dataset's samples 98, 23, 20, 29, 78 and 31 more",
    ]
    # The samples named are DistributedSampler's at positions 36-40 of epoch 0's order (seed 0, 100 samples);
    # tests/test_data_reshard.py checks them against the indices a planted run really trained twice.
    assert torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()[36:41] == [98, 23, 20, 29, 78]
    (line,) = report.ledger
    assert line.startswith("all ranks, world size 4 → 2: ") and not proven(line)
    done = cli_audit(planted)
    assert done.returncode == 1 and "[ledger] world size 4 → 2, epoch 0: 36 positions of its order" in done.stdout


def test_positions_skipped_at_a_resume_on_another_world_size_are_named_with_the_attempt_that_went_past(
    tmp_path: Path,
) -> None:
    """Attempt 1 (2 ranks) resumes each rank at micro-batch 20, not 18: positions 72-79 never trained."""
    report = audit.audit([edited(tmp_path, resumed_at(1, batches=20))])
    assert ledger_problems(report) == [
        "attempt 1 on 2 ranks says it continued checkpoint 3's position 72 of epoch 0 (data_resumed.global), but "
        "ranks 0-1 counted from micro-batch 20 of epoch 0, which is position 80 at 2 ranks with batches of 2: the "
        "ranks did not skip to the global position",
        "world size 4 → 2 → 3, epoch 0: 8 positions of its order never trained, from position 72 to 79 (attempt 1 "
        "went on past them); the dataset's samples 25, 47, 36, 96, 9 and 3 more",
    ]
    assert {p.attempt for p in report.run_problems} == {1}


def test_a_resume_that_continues_another_global_position_than_its_checkpoint_saved_is_named(tmp_path: Path) -> None:
    report = audit.audit([edited(tmp_path, resumed_at(1, **{"global": {"epoch": 0, "samples": 64}}))])
    assert ledger_problems(report) == [
        "attempt 1 on 2 ranks continued from epoch 0 position 64 (data_resumed.global), but checkpoint 3 saved epoch 0 "
        "position 72"
    ]


# ---------------------------------------------------------------- what cannot be proven
def test_an_approximate_resume_the_user_accepted_is_a_note_with_what_it_cost_not_a_problem(tmp_path: Path) -> None:
    why = "the saved position, 72 samples into epoch 0, is not a multiple of world size 2 x batch size 2 (edited)"
    report = audit.audit([edited(tmp_path, resumed_at(1, batches=16, exact=False, approximate=why))])
    assert report.run_problems == []
    # The edit moved the start back 2 micro-batches and kept the draws: 64-71 twice, and epoch 0's end short.
    assert [n.message for n in report.notes] == [
        f"attempt 1: resumed on another world size approximately, as accepted: {why}",
        "attempt 1 continued approximately, as accepted: epoch 0: 8 positions of its order trained twice, from "
        "position 64 to 71 (position 64: attempt 0 rank 0 and attempt 1 rank 0); the dataset's samples 32, 34, 11, 0, "
        "22 and 3 more",
        "attempt 1 continued approximately, as accepted: epoch 0: 8 positions of its order never trained, from "
        "position 88 to 95 (the epoch's end); the dataset's samples 64, 88, 38, 27, 14 and 3 more",
    ]
    (line,) = report.ledger
    assert line.endswith(": not proven: attempt 1 continued approximately, as accepted") and not proven(line)
    assert cli_audit(tmp_path).returncode == 0


def test_a_change_of_world_size_whose_order_is_unknown_cannot_be_checked_and_says_so(tmp_path: Path) -> None:
    why = "StatefulDataLoader draws no torch DistributedSampler (edited)"

    def unknown(event: dict[str, Any]) -> dict[str, Any]:
        if event["event"] == "data_layout" and event["attempt"] == 1:
            return {**event, "order": "unknown", "why": why}
        return event

    report = audit.audit([edited(tmp_path, unknown)])
    cannot = f"attempt 1 on 2 ranks: the order of its samples is unknown: {why}"
    assert report.ledger == [f"all ranks, world size 4 → 2 → 3: cannot be checked: {cannot}"]
    assert [n.message for n in report.notes] == [
        f"the data ledger cannot be checked across world size 4 → 2 → 3: {cannot}"
    ]
    assert report.run_problems == []


def test_a_trail_from_before_the_contract_resumed_on_another_world_size_cannot_be_checked(tmp_path: Path) -> None:
    """Format 3 (trainfsm before issue 49): no layout, no global positions. Its ledger said "each
    batch drawn once" of every rank, while 36 samples were trained twice."""

    def format_3(event: dict[str, Any]) -> dict[str, Any] | None:
        if event["event"] == "data_layout":
            return None
        if event["event"] == "run_start":
            return {**event, "format": 3}
        return event

    report = audit.audit([edited(tmp_path, format_3, DATA / "planted")])
    cannot = (
        "attempt 0 on 4 ranks: its trail (format 3) records no data layout; which samples each rank drew is unknown"
    )
    assert report.ledger == [f"all ranks, world size 4 → 2: cannot be checked: {cannot}"]
    assert not any(proven(line) for line in report.ledger)


# ---------------------------------------------------------------- the recorded trails are today's
@pytest.mark.slow
@pytest.mark.parametrize("name", ["clean", "planted"])
def test_a_run_recorded_now_gets_the_ledger_the_checked_in_trail_gets(tmp_path: Path, name: str) -> None:
    """The trails above are the trainer's of when they were recorded: gloo ranks of the same plan,
    run now, must audit alike (15-20 s each)."""
    live = audit.audit([reshard_trails.record(name, tmp_path / "ws").parent])
    recorded = audit.audit([DATA / name])
    assert (live.ledger, live.ledger_checked, ledger_problems(live)) == (
        recorded.ledger,
        recorded.ledger_checked,
        ledger_problems(recorded),
    )
