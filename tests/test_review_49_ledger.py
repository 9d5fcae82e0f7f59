"""The data ledger as a second reviewer of issue 49 found it: each test is a finding (it failed
before its fix), now the behaviour that holds. The trails are the real ones of
``tests/test_ledger_sizes.py`` (``tests/faults/reshard_trails.py``), edited where a case needs it,
or runs of ``tests/distributed/reshard_worker.py`` made here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.test_ledger_sizes import CLEAN, cli_audit, edited, ledger_problems
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
