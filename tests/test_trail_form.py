"""The trail at scale: compact routine steps, the write-out bound, rotation into gzip segments."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import EVENTS_FILE, TinyTrainer, make_batches, outline, trail_events
from trainfsm import CheckpointingHook
from trainfsm.tools.audit import audit
from trainfsm.trail import writer as events
from trainfsm.trail.reader import expand_steps
from trainfsm.trail.schema import FORMAT_VERSION


def raw_lines(workspace: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (workspace / EVENTS_FILE).read_text().splitlines()]


def train(workspace: Path, steps: int = 20, **kwargs: Any) -> TinyTrainer:
    kwargs.setdefault("batches", make_batches(64))
    trainer = TinyTrainer(max_steps=steps, workspace=workspace, **kwargs)
    trainer.train()
    return trainer


# ---------------------------------------------------------------- the compact form
def test_routine_steps_between_checkpoints_are_one_record_each_run(tmp_path: Path) -> None:
    train(tmp_path, 20, hooks=[CheckpointingHook(interval=8)], gradient_accumulation_steps=2)
    lines = raw_lines(tmp_path)
    steps = [(e["first"], e["step"], e["micro"], len(e["dt"])) for e in lines if e["event"] == "steps"]
    assert steps == [(2, 7, 2, 6), (10, 15, 2, 6), (18, 19, 2, 2)]
    # Step 1 draws the first epoch's first batch (its ``epoch`` event); steps 8 and 16 save (a
    # checkpoint is not routine) and 20 finishes: verbatim, as before; so are 9 and 17, whose
    # first batch is the data ledger's fingerprint after a save.
    verbatim = [(e["step"], e["trigger"]) for e in lines if e["event"] == "transition" and e["step"] in (8, 20)]
    saved_at_8 = [(8, "micro"), (8, "micro"), (8, "save"), (8, "resume")]
    assert verbatim == [*saved_at_8, (20, "micro"), (20, "micro"), (20, "save"), (20, "finish")]
    stepped = [e["step"] for e in lines if e["event"] == "transition" and e["trigger"] == "stepped"]
    assert stepped == [1, 9, 17]  # 1: its first batch's ``epoch`` event (the fingerprint) is not routine


def test_the_compact_form_expands_to_exactly_the_full_forms_transitions(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"gradient_accumulation_steps": 3, "max_non_finite_grad_retries": 1}
    script = {7: "nan", 20: "none"}  # a retry at step 3 and a loss=None skip: both verbatim
    train(tmp_path / "compact", 12, script=script, hooks=[CheckpointingHook(interval=5)], **kwargs)
    train(tmp_path / "full", 12, script=script, hooks=[CheckpointingHook(interval=5)], trail_form="full", **kwargs)
    compact, full = trail_events(tmp_path / "compact"), trail_events(tmp_path / "full")
    assert outline(compact) == outline(full)
    assert [e["step"] for e in compact] == [e["step"] for e in full]
    assert [e["state"] for e in compact] == [e["state"] for e in full]
    assert len(raw_lines(tmp_path / "compact")) < len(raw_lines(tmp_path / "full"))
    assert all(e["event"] != "steps" for e in raw_lines(tmp_path / "full"))


def test_expanded_times_are_each_steps_start_and_end(tmp_path: Path) -> None:
    record = {
        "ts": 10.5,
        "event": "steps",
        "rank": 0,
        "run_id": "r",
        "attempt": 0,
        "step": 4,
        "state": "STEP",
        "first": 3,
        "micro": 2,
        "dt": [200_000, 300_000],
    }
    rows = expand_steps(record)
    assert [(e["ts"], e["step"], e["trigger"], e["source"], e["dest"]) for e in rows] == [
        (10.0, 3, "micro", "STEP", "ACCUMULATE"),
        (10.0, 3, "micro", "ACCUMULATE", "ACCUMULATE"),
        (pytest.approx(10.2), 3, "stepped", "ACCUMULATE", "STEP"),
        (pytest.approx(10.2), 4, "micro", "STEP", "ACCUMULATE"),
        (pytest.approx(10.2), 4, "micro", "ACCUMULATE", "ACCUMULATE"),
        (pytest.approx(10.5), 4, "stepped", "ACCUMULATE", "STEP"),
    ]


def test_a_routine_step_costs_a_few_bytes_in_the_compact_form(tmp_path: Path) -> None:
    train(tmp_path / "compact", 200, batches=make_batches(256))  # one epoch: no epoch event
    train(tmp_path / "full", 200, batches=make_batches(256), trail_form="full")
    compact, full = (tmp_path / p / EVENTS_FILE for p in ("compact", "full"))
    per_step = (compact.stat().st_size - 1500) / 200  # less run_start, restore and exit
    assert per_step < 12, per_step
    assert full.stat().st_size > 20 * compact.stat().st_size


def test_trail_form_is_checked_and_recorded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trail_form must be one of 'compact', 'full'; got 'short'"):
        TinyTrainer(max_steps=1, trail_form="short")
    train(tmp_path, 2, trail_form="full")
    start = raw_lines(tmp_path)[0]
    assert start["trail"] == {"form": "full", "flush_seconds": events.FLUSH_SECONDS, "segment_bytes": 64 << 20}


# ---------------------------------------------------------------- the write-out bound
class Slow(TinyTrainer):
    """Each forward takes ``seconds``; records what the file held when each step began."""

    def __init__(self, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds
        self.on_disk: list[tuple[int, int]] = []  # (step, the trail's last recorded step) at forward

    def forward(self, input: Any) -> Any:
        time.sleep(self.seconds)
        path = self.workspace / EVENTS_FILE  # type: ignore[operator]
        lines = [json.loads(line) for line in path.read_bytes().splitlines()]
        self.on_disk.append((self.step, max(e["step"] for e in lines if e["event"] in ("steps", "transition"))))
        return super().forward(input)


def test_steps_longer_than_the_interval_are_on_disk_when_the_next_begins(tmp_path: Path) -> None:
    trainer = Slow(events.FLUSH_SECONDS + 0.05, max_steps=4, workspace=tmp_path, batches=make_batches(8))
    trainer.train()
    # Read from the file (not the process): when step k's forward has slept, step k-1 is written.
    assert trainer.on_disk[1:] == [(2, 1), (3, 2), (4, 3)]


def test_short_steps_are_written_within_the_interval(tmp_path: Path) -> None:
    trainer = Slow(0.05, max_steps=24, workspace=tmp_path, batches=make_batches(32))
    trainer.train()
    lags = [step - 1 - written for step, written in trainer.on_disk[1:]]
    # 0.05 s steps, 0.5 s interval: at most 0.5 / 0.05 + 1 steps not yet written; some written.
    assert max(lags) <= 11 and min(lags) == 0, lags
    assert len([e for e in raw_lines(tmp_path) if e["event"] == "steps"]) >= 2


def test_without_the_interval_check_routine_steps_wait_for_the_next_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events, "FLUSH_SECONDS", 1e9)
    trainer = Slow(0.02, max_steps=6, workspace=tmp_path, batches=make_batches(8))
    trainer.train()
    assert {written for _, written in trainer.on_disk} == {0}  # the mechanism is what bounds the loss


# ---------------------------------------------------------------- segments
def rotated(workspace: Path, monkeypatch: pytest.MonkeyPatch, steps: int = 40) -> TinyTrainer:
    monkeypatch.setattr(events, "SEGMENT_BYTES", 1500)  # the writer reads it when a log opens
    return train(workspace, steps, hooks=[CheckpointingHook(interval=3)])


def test_the_trail_rotates_into_gzip_segments_read_back_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rotated(tmp_path / "rotated", monkeypatch)
    train(tmp_path / "one", 40, hooks=[CheckpointingHook(interval=3)])
    logs = tmp_path / "rotated" / "logs"
    names = sorted(p.name for p in logs.iterdir())
    assert len(names) >= 4 and names[-1] == "events.rank0.jsonl"
    assert names[:-1] == [f"events.rank0.{n:05d}.jsonl.gz" for n in range(1, len(names))]
    for name in names[:-1]:
        assert gzip.decompress((logs / name).read_bytes()).endswith(b"}\n")  # whole lines only
    assert outline(trail_events(tmp_path / "rotated")) == outline(trail_events(tmp_path / "one"))
    report = audit([tmp_path / "rotated"])
    assert report.consistent and report.attempts[0].first.steps_done == 40
    assert report.files[0]["path"] == str(logs / "events.rank0.jsonl")


def test_a_segment_left_plain_by_a_kill_is_read_and_then_compressed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rotated(tmp_path, monkeypatch, 20)
    logs = tmp_path / "logs"
    first = logs / "events.rank0.00001.jsonl.gz"
    plain = logs / "events.rank0.00001.jsonl"
    plain.write_bytes(gzip.decompress(first.read_bytes()))  # killed between compressing and deleting
    first.with_name(first.name + ".tmp").write_bytes(b"half")  # and another kill mid-compression
    first.write_bytes(b"not gzip at all")  # the plain file is what counts
    assert audit([tmp_path]).consistent
    train(tmp_path, 30, hooks=[CheckpointingHook(interval=3)])  # resumes; finishes the compression
    assert not plain.exists() and not first.with_name(first.name + ".tmp").exists()
    assert gzip.decompress(first.read_bytes()).startswith(b'{"')
    report = audit([tmp_path])
    assert report.consistent and [a.first.start for a in report.attempts] == ["launch", "resume"]


def test_a_kill_right_after_rotating_leaves_the_attempt_count_in_the_last_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rotated(tmp_path, monkeypatch, 20)
    (tmp_path / EVENTS_FILE).write_bytes(b"")  # the new file was opened, nothing written yet
    train(tmp_path, 24, hooks=[CheckpointingHook(interval=3)])
    resumed = [e for e in trail_events(tmp_path) if e["event"] == "run_start"]
    assert [e["attempt"] for e in resumed] == [0, 1]
    assert len({e["run_id"] for e in resumed}) == 1


# ---------------------------------------------------------------- older trails
FORMAT_1 = Path(__file__).parent / "data" / "format1"  # written by trainfsm before steps records


def test_a_format_1_trail_is_still_read_and_audited() -> None:
    assert all(e["event"] != "steps" for e in trail_events(FORMAT_1))
    report = audit([FORMAT_1])
    assert report.consistent, report.problems
    [attempt] = report.attempts
    assert (attempt.first.steps_done, attempt.first.micro_batches) == (6, 14)
    assert [r["step"] for r in attempt.first.retries] == [2]


def test_a_run_begun_in_format_1_and_continued_in_the_current_format_reads_as_one_trail(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / EVENTS_FILE).write_bytes((FORMAT_1 / "logs" / "events.rank0.jsonl").read_bytes())
    train(tmp_path, 6)
    starts = [e for e in trail_events(tmp_path) if e["event"] == "run_start"]
    assert [(e["format"], e["attempt"]) for e in starts] == [(1, 0), (FORMAT_VERSION, 1)]
    assert len({e["run_id"] for e in starts}) == 1
    assert any(e["event"] == "steps" for e in raw_lines(tmp_path))
    report = audit([tmp_path])
    assert report.consistent and [a.first.steps_done for a in report.attempts] == [6, 6]
