"""Audits of many ranks: replayed side by side in processes, reported on one screen."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.trail import write_trail

from trainfsm.tools import audit as audit_module
from trainfsm.tools.audit import audit, audit_trail, render
from trainfsm.tools.cli import main
from trainfsm.trail.reader import open_trail


def job(logs: Path, ranks: int, steps: int, short: dict[int, int] | None = None, killed: bool = False) -> Path:
    """``ranks`` trails written by EventLog; ``short`` gives some ranks fewer steps."""
    logs.mkdir(parents=True)
    for rank in range(ranks):
        write_trail(logs, rank, (short or {}).get(rank, steps), checkpoint_every=50, killed=killed, world_size=ranks)
    return logs


def test_a_parallel_audit_reports_exactly_what_a_serial_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = job(tmp_path / "logs", 6, 300, short={4: 290})
    pools: list[int] = []

    class Counted(audit_module.ProcessPoolExecutor):  # type: ignore[misc]
        def __init__(self, max_workers: int) -> None:
            pools.append(max_workers)
            super().__init__(max_workers=max_workers)

    monkeypatch.setattr(audit_module, "ProcessPoolExecutor", Counted)
    serial, parallel = audit([logs], jobs=1), audit([logs], jobs=2)
    assert pools == [2]  # the second really ran in two worker processes
    assert serial.as_dict() == parallel.as_dict()
    assert main(["audit", "--jobs", "2", str(logs)]) == 3 and pools == [2, 2]
    assert "rank 4 290 (steps 1-290)" in capsys.readouterr().out
    assert not serial.consistent and [p.kind for p in serial.problems] == ["rank_disagreement"]


def test_jobs_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = job(tmp_path / "logs", 2, 10)
    with pytest.raises(ValueError, match="jobs must be a positive number of processes; got 0"):
        audit([logs], jobs=0)
    with pytest.raises(SystemExit) as exited:
        main(["audit", "--jobs", "0", str(logs)])
    assert exited.value.code == 2 and "--jobs: must be a positive integer, got '0'" in capsys.readouterr().err


def test_ranks_that_agree_are_one_group_and_only_those_that_differ_are_listed(tmp_path: Path) -> None:
    logs = job(tmp_path / "logs", 64, 120, short={10: 100, 11: 100, 12: 100, 40: 110})
    report = audit([logs])
    text = render(report)
    lines = text.splitlines()
    assert len(lines) < 25, text
    assert "attempt 0: launch, ranks 0-63," in text
    messages = [p.message for p in report.problems if p.message.startswith("attempt 0: steps done")]
    assert messages == [
        "attempt 0: steps done: rank 0 120 (steps 1-120), ranks 10-12 100 (steps 1-100)",
        "attempt 0: steps done: rank 0 120 (steps 1-120), rank 40 110 (steps 1-110)",
    ]


def test_a_job_whose_ranks_all_died_at_once_is_one_line_of_run_problems(tmp_path: Path) -> None:
    logs = job(tmp_path / "logs", 64, 80, killed=True)
    report = audit([logs])
    assert report.consistent and not report.ended_well
    [killed] = report.run_problems
    assert killed.kind == "killed"
    assert killed.message.startswith(
        "attempt 0: ranks 0-63 killed: no exit event, their trails end in STEP running step 81"
    )
    text = render(report)
    assert "exit: none: ranks 0-63 killed at their last records: STEP running step 81" in text
    assert len(text.splitlines()) <= 20, text  # 20: the data ledger's line and its "checked" line included


def test_a_long_section_shows_its_first_lines_and_counts_the_rest(tmp_path: Path) -> None:
    logs = job(tmp_path / "logs", 30, 40, short={r: r for r in range(1, 30)})  # 29 different step counts
    report = audit([logs])
    text = render(report)
    assert "  ... and " in text and " more (--json lists them all)" in text
    assert len(report.problems) > 20 and len(text.splitlines()) < 40


def test_the_readers_fast_path_for_steps_records_reports_what_the_record_path_does(tmp_path: Path) -> None:
    logs = job(tmp_path / "logs", 3, 400, short={2: 390})
    fast = audit([logs], jobs=1)
    seen: list[int] = []
    slow = audit_trail(open_trail([logs]), observe=lambda record: seen.append(record.line))  # every line a Record
    assert fast.as_dict() == slow.as_dict()
    assert len(seen) == sum(f["events"] for f in fast.files)
