"""The audit trail on disk and the console rendering through the stdlib logger."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

import trainfsm
from tests.helpers import (
    COMMON_FIELDS,
    EVENTS_FILE,
    RecordingHook,
    TinyTrainer,
    assert_valid_chain,
    make_batches,
    outline,
    read_events,
    transitions_of,
)
from trainfsm import STATES, BaseHook, BaseTrainer
from trainfsm.trail.console import details
from trainfsm.trail.schema import EVENT_FIELDS, FORMAT_VERSION
from trainfsm.trail.writer import BATCH, render_console


# ---------------------------------------------------------------- the file
def test_trail_is_written_to_logs_events_rank0_jsonl(make_trainer, tmp_path):
    make_trainer(max_steps=1).train()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "logs",
        EVENTS_FILE.as_posix(),
    ]


def test_every_event_has_the_common_fields(make_trainer, events):
    make_trainer(max_steps=2, max_non_finite_grad_retries=1, script={1: "nan", 3: "none"}).train()
    all_events = events()
    run_id = all_events[0]["run_id"]
    assert re.fullmatch(r"[0-9a-f]{12}", run_id)
    for event in all_events:
        assert set(COMMON_FIELDS) <= set(event), event
        assert isinstance(event["ts"], float)
        assert (event["rank"], event["run_id"], event["attempt"]) == (0, run_id, 0)
        assert isinstance(event["step"], int)
        assert event["state"] in STATES
        assert set(EVENT_FIELDS[event["event"]]) <= set(event), event


def test_transition_events_have_exactly_trigger_source_dest(make_trainer, events):
    make_trainer(max_steps=2).train()
    for event in events():
        if event["event"] == "transition":
            assert set(event) == {*COMMON_FIELDS, "trigger", "source", "dest"}
            assert event["state"] == event["dest"]


def test_run_start_records_the_configuration(make_trainer, events, tmp_path):
    make_trainer(
        max_steps=4, grad_clip=2.0, max_non_finite_grad_retries=3, gradient_accumulation_steps=2, max_epochs=7
    ).train()
    start = events()[0]
    assert (start["event"], start["state"], start["step"], start["format"]) == ("run_start", "BUILD", 0, FORMAT_VERSION)
    assert (start["world_size"], start["max_steps"]) == (1, 4)
    assert start["config"] == {
        "grad_clip": 2.0,
        "max_non_finite_grad_retries": 3,
        "max_oom_retries": 0,
        "mixed_precision": None,
        "device": "cpu",
        "gradient_accumulation_steps": 2,
        "workspace": str(tmp_path),
        "max_epochs": 7,
        "loss_none_agreement": False,
    }
    assert start["versions"]["trainfsm"] == trainfsm.__version__
    assert set(start["versions"]) == {"trainfsm", "torch", "python"}


def test_restore_and_exit_event_fields(make_trainer, events):
    make_trainer(max_steps=2).train()
    restore = next(e for e in events() if e["event"] == "restore")
    exit_ = events()[-1]
    assert (restore["resumed"], restore["from_step"], restore["state"]) == (False, 0, "RESTORE")
    assert (exit_["event"], exit_["reason"], exit_["code"], exit_["step"], exit_["state"]) == (
        "exit",
        "completed",
        0,
        2,
        "EXIT",
    )


def test_file_order_is_time_order_across_transition_batches(make_trainer, events):
    # 40 steps of 2 micro-batches: well over one batch of buffered transitions, with decision
    # events (a retry, an epoch) in between.
    trainer = make_trainer(
        max_steps=40, gradient_accumulation_steps=2, max_non_finite_grad_retries=1, script={41: "nan"}
    )
    trainer.train()
    all_events = events()
    rows = transitions_of(all_events)
    assert len(rows) > BATCH
    assert_valid_chain(rows)
    stamps = [e["ts"] for e in all_events]
    assert stamps == sorted(stamps)
    names = outline(all_events)
    retry_at = names.index("non_finite:gradients")
    assert names[retry_at - 1] == "non_finite:ACCUMULATE>RETRY"
    assert names[retry_at + 1] == "retry:RETRY>ACCUMULATE"
    assert names.count("epoch") == 11  # 8 batches per epoch, 82 drawn: epochs 0 to 10 began


def test_all_transitions_are_flushed_when_train_raises(make_trainer, events):
    trainer = make_trainer(max_steps=50, script={45: ValueError("late")})
    with pytest.raises(ValueError):
        trainer.train()
    rows = transitions_of(events())
    assert_valid_chain(rows)
    assert len(rows) == 2 + 2 * 44 + 1 + 1  # built, restored, 44 full steps, micro, fail
    assert rows[-1] == ("fail", "ACCUMULATE", "EXIT")


def test_decision_events_reach_the_file_immediately(make_trainer, tmp_path):
    seen: list[list[str]] = []

    class Peek(BaseHook):
        def on_exit_retry(self, trainer: BaseTrainer) -> None:
            seen.append(outline(read_events(tmp_path)))

    make_trainer(max_steps=1, max_non_finite_grad_retries=1, script={1: "nan"}, hooks=[Peek()]).train()
    # A process killed now would lose nothing up to the retry decision, transitions included.
    assert seen == [
        [
            "run_start",
            "built:BUILD>RESTORE",
            "data_layout",
            "restore",
            "restored:RESTORE>STEP",
            "micro:STEP>ACCUMULATE",
            "epoch",  # the first epoch's first batch (its fingerprint)
            "non_finite:ACCUMULATE>RETRY",
            "non_finite:gradients",
        ]
    ]


def open_paths() -> set[str]:
    fds = Path("/proc/self/fd")
    out = set()
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # closed between listing and reading
            out.add(os.readlink(fd))
    return out


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd to list open files")
@pytest.mark.parametrize("script", [{}, {2: ValueError("boom")}], ids=["completed", "failed"])
def test_the_trail_file_is_closed_when_train_returns_or_raises(make_trainer, tmp_path, script):
    trainer = make_trainer(max_steps=3, script=script)
    with pytest.raises(ValueError) if script else contextlib.nullcontext():
        trainer.train()
    assert str((tmp_path / EVENTS_FILE).resolve()) not in open_paths()
    assert read_events(tmp_path)[-1]["event"] == "exit"


def test_second_launch_is_the_next_attempt_of_the_same_run(tmp_path):
    TinyTrainer(max_steps=1, workspace=tmp_path).train()
    first = read_events(tmp_path)
    second_trainer = TinyTrainer(max_steps=2, workspace=tmp_path)
    second_trainer.train()
    both = read_events(tmp_path)
    assert both[: len(first)] == first  # appended, not rewritten
    second = both[len(first) :]
    assert second[0]["event"] == "run_start"
    assert {e["attempt"] for e in first} == {0}
    assert {e["attempt"] for e in second} == {1}
    assert {e["run_id"] for e in both} == {first[0]["run_id"]}
    assert (second_trainer.run_id, second_trainer.attempt) == (first[0]["run_id"], 1)


def test_third_launch_is_attempt_two(tmp_path):
    for _ in range(3):
        TinyTrainer(max_steps=1, workspace=tmp_path).train()
    assert [e["attempt"] for e in read_events(tmp_path) if e["event"] == "run_start"] == [0, 1, 2]


def test_a_truncated_last_line_does_not_break_the_next_attempt(tmp_path):
    TinyTrainer(max_steps=1, workspace=tmp_path).train()
    path = tmp_path / EVENTS_FILE
    run_id = read_events(tmp_path)[0]["run_id"]
    with open(path, "ab") as f:
        f.write(b'{"ts": 1.0, "event": "transi')  # a writer killed mid-line
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path)
    trainer.train()
    assert (trainer.run_id, trainer.attempt) == (run_id, 1)


def test_different_workspaces_are_different_runs(tmp_path):
    a = TinyTrainer(max_steps=1, workspace=tmp_path / "a")
    b = TinyTrainer(max_steps=1, workspace=tmp_path / "b")
    a.train()
    b.train()
    assert a.run_id != b.run_id
    assert (a.attempt, b.attempt) == (0, 0)


def test_no_workspace_writes_no_files(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="trainfsm")
    trainer = TinyTrainer(max_steps=2, workspace=None)
    trainer.train()
    assert list(tmp_path.iterdir()) == []
    assert trainer.attempt == 0
    assert re.fullmatch(r"[0-9a-f]{12}", trainer.run_id)
    # The console still gets the decision events.
    assert caplog.messages[-1] == "Done: completed at step 2 (exit code 0)."


def test_failure_in_build_records_fail_transition_and_exit(tmp_path, events):
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path)
    trainer.build_model = lambda: None  # type: ignore[method-assign]
    with pytest.raises(TypeError):
        trainer.train()
    assert outline(events()) == ["run_start", "exception:TypeError", "fail:BUILD>EXIT", "exit:failed"]


def test_an_on_after_train_exception_is_recorded_once(make_trainer, events):
    class Boom(BaseHook):
        def on_after_train(self, trainer: BaseTrainer) -> None:
            raise ValueError("after train failed")

    with pytest.raises(ValueError):
        make_trainer(max_steps=1, hooks=[Boom()]).train()
    assert [e["message"] for e in events() if e["event"] == "exception"] == ["after train failed"]


def test_exit_is_recorded_when_closing_the_data_iterator_fails(make_trainer, events):
    class Stream:
        def __iter__(self) -> Iterator[Any]:
            try:
                yield from make_batches(10)
            finally:
                raise OSError("close failed")

    with pytest.raises(OSError, match="close failed"):
        make_trainer(max_steps=2, batches=Stream()).train()
    names = outline(events())
    assert "exception:OSError" in names
    assert names[-1].startswith("exit:")


def test_loss_none_is_a_debug_event_in_the_file_only(make_trainer, events, caplog):
    caplog.set_level(logging.INFO, logger="trainfsm")
    make_trainer(max_steps=1, script={1: "none"}).train()
    assert "loss_none" in outline(events())
    assert [m.split(" ")[0] for m in caplog.messages] == ["Starting", "Done:"]
    assert not [m for m in caplog.messages if "loss" in m]


# ---------------------------------------------------------------- the console
def records_of(caplog: pytest.LogCaptureFixture, name: str = "trainfsm") -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name]


def test_console_shows_decision_events_at_info_as_sentences(make_trainer, caplog):
    caplog.set_level(logging.INFO, logger="trainfsm")
    trainer = make_trainer(max_steps=2)
    trainer.train()
    records = records_of(caplog)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.INFO, f"Starting fresh at step 0 (run {trainer.run_id}, attempt 0)."),
        (logging.INFO, "Done: completed at step 2 (exit code 0)."),
    ]


def test_console_shows_transitions_at_debug_only(make_trainer, events, caplog):
    caplog.set_level(logging.DEBUG, logger="trainfsm")
    make_trainer(max_steps=2).train()
    transition_records = [r for r in records_of(caplog) if " transition " in r.getMessage()]
    assert {r.levelno for r in transition_records} == {logging.DEBUG}
    assert [r.getMessage() for r in transition_records] == [
        "[rank 0] step 0 RESTORE transition trigger=built source=BUILD dest=RESTORE",
        "[rank 0] step 0 STEP transition trigger=restored source=RESTORE dest=STEP",
        "[rank 0] step 1 ACCUMULATE transition trigger=micro source=STEP dest=ACCUMULATE",
        "[rank 0] step 1 STEP transition trigger=stepped source=ACCUMULATE dest=STEP",
        "[rank 0] step 2 ACCUMULATE transition trigger=micro source=STEP dest=ACCUMULATE",
        "[rank 0] step 2 EXIT transition trigger=finish source=ACCUMULATE dest=EXIT",
    ]
    # The console saw every event's fields at DEBUG in the same order as the file, transitions
    # interleaved with the other events; the events people read came as sentences too.
    fields = [
        r for r in records_of(caplog) if r.levelno == logging.DEBUG and r.getMessage().startswith("[rank 0] step ")
    ]
    assert [r.getMessage().split(" ")[5] for r in fields] == [e["event"] for e in events()]
    sentences = [r.getMessage() for r in records_of(caplog) if r not in fields]
    assert [s.split(" ")[0] for s in sentences] == ["Run", "Starting", "Done:"]


def test_console_shows_problems_as_warnings_and_errors(make_trainer, caplog):
    caplog.set_level(logging.WARNING, logger="trainfsm")
    with pytest.raises(RuntimeError):
        make_trainer(max_steps=2, max_non_finite_grad_retries=1, script={1: "nan", 2: "nan"}).train()
    records = records_of(caplog)
    assert [r.levelno for r in records] == [logging.WARNING, logging.ERROR]
    assert records[0].getMessage() == "Non-finite gradients at step 1: running the step again (retry 1 of 1)."
    assert records[1].getMessage().startswith("[rank 0] RuntimeError at step 1 (RETRY): Step 1: ")
    assert "Traceback" not in records[1].getMessage()


def test_console_uses_the_logger_given_to_the_trainer(make_trainer, caplog):
    caplog.set_level(logging.INFO)
    make_trainer(max_steps=1, logger=logging.getLogger("my.training")).train()
    assert records_of(caplog, "trainfsm") == []
    assert records_of(caplog, "my.training")[-1].getMessage() == "Done: completed at step 1 (exit code 0)."


def test_console_at_warning_shows_nothing_for_a_clean_run(make_trainer, caplog):
    caplog.set_level(logging.WARNING, logger="trainfsm")
    make_trainer(max_steps=2).train()
    assert records_of(caplog) == []


def test_training_leaves_structlog_and_logging_configuration_alone(make_trainer):
    config = structlog.get_config()
    root_handlers = list(logging.getLogger().handlers)
    level = logging.getLogger("trainfsm").level
    make_trainer(max_steps=1).train()
    assert structlog.get_config() == config
    assert logging.getLogger().handlers == root_handlers
    assert logging.getLogger("trainfsm").level == level


def test_the_fields_at_debug_skip_identity_fields():
    line = details(
        {
            "ts": 1.0,
            "event": "checkpoint_saved",
            "rank": 3,
            "run_id": "abc",
            "attempt": 2,
            "traceback": "...",
            "step": 12,
            "state": "CHECKPOINT",
            "path": "/ckpt/12",
            "bytes": 10,
        }
    )
    assert line == "[rank 3] step 12 CHECKPOINT checkpoint_saved path=/ckpt/12 bytes=10"


def test_render_console_is_the_sentence_or_else_the_fields():
    stall = {"event": "stall", "rank": 1, "step": 87, "state": "ACCUMULATE", "seconds": 62.0, "doing": "a barrier"}
    assert render_console(stall) == "[rank 1] Stalled 62.0 s at step 87 (ACCUMULATE) in a barrier."
    assert render_console({"event": "my_event", "rank": 0, "step": 3, "state": "STEP", "x": 1}) == (
        "[rank 0] step 3 STEP my_event x=1"
    )


def test_recording_hook_sees_the_same_steps_as_the_trail(make_trainer, events):
    log: list[tuple[str, str, int]] = []
    make_trainer(max_steps=3, hooks=[RecordingHook(log)]).train()
    before_steps = [s for _, m, s in log if m == "on_before_step"]
    micro_steps = [e["step"] for e in events() if e["event"] == "transition" and e["trigger"] == "micro"]
    assert before_steps == micro_steps == [1, 2, 3]


def test_the_schema_documents_every_event_and_each_field_it_lists() -> None:
    # The docs' event reference is generated from EVENT_DOCS: an event without a line there, or a
    # field its description leaves out, would be missing from it.
    from trainfsm.trail.schema import COMMON_FIELDS as DOCUMENTED_COMMON
    from trainfsm.trail.schema import EVENT_DOCS

    assert EVENT_DOCS.keys() == EVENT_FIELDS.keys()
    for event, fields in EVENT_FIELDS.items():
        described, when = EVENT_DOCS[event]
        assert when, event
        assert all(f"`{field}`" in described for field in fields), event
    assert set(DOCUMENTED_COMMON) == set(COMMON_FIELDS)
