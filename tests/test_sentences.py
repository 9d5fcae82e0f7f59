"""The console's sentences (``trainfsm.trail.sentences``): every event kind of the schema has one,
each reads in one short line with no dicts or checksums, and only rank 0 speaks for all ranks."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from tests.helpers import TinyTrainer, read_events
from trainfsm import CheckpointingHook
from trainfsm.trail.console import OWN, WIDTH, lines, sentence
from trainfsm.trail.examples import FIELDS, LONG, example
from trainfsm.trail.schema import EVENT_FIELDS
from trainfsm.trail.sentences import SENTENCES

#: Events whose sentence quotes free text (an error's message): cut to fit.
FREE_TEXT = {"exception", "checkpoint_failed", "checkpoint_skipped", "collective_failed"}


def event(name: str, rank: int = 0, **fields: Any) -> dict[str, Any]:
    return example(name, rank=rank, **fields)


def test_every_event_kind_of_the_schema_has_a_sentence_or_is_the_trails_alone():
    assert list(SENTENCES) == list(EVENT_FIELDS)  # the same kinds, in the schema's order
    assert FIELDS.keys() == EVENT_FIELDS.keys()  # and one example of each


@pytest.mark.parametrize("name", list(EVENT_FIELDS))
def test_each_event_renders_as_one_short_line_without_dicts_or_checksums(name: str) -> None:
    text = sentence(event(name))
    for level, line in lines(event(name), logging.INFO):
        if level < logging.INFO:
            continue
        assert line == text  # the line people read at INFO is the sentence, nothing else
        assert len(line) <= WIDTH, line
        assert name in FREE_TEXT or not line.endswith("..."), line  # it fits, not cut
        assert "\n" not in line
        assert not re.search(r"[{}]|\[['\"\]]|[0-9a-f]{16}", line), line  # no dict, list or checksum
        assert not re.search(r"\b[a-z_]+=[^ ]", line.replace("load=None", "").replace("stall_action=exit", ""))


@pytest.mark.parametrize("name", [name for name, render in SENTENCES.items() if render is not None])
def test_a_sentence_takes_an_event_with_its_fields_missing(name: str) -> None:
    bare = {"ts": 1.0, "event": name, "rank": 0, "run_id": "r", "attempt": 0, "step": 1, "state": "STEP"}
    render = SENTENCES[name]
    assert render is not None
    render(bare)  # an old format's event, or a field null: it must not raise


def test_only_rank_0_speaks_at_info_unless_the_event_is_a_ranks_own():
    saved = event("checkpoint_saved", rank=1)
    assert [level for level, _ in lines(saved, logging.INFO)] == [logging.DEBUG, logging.DEBUG]
    non_finite = event("non_finite", rank=3)
    assert [level for level, _ in lines(non_finite, logging.WARNING)] == [logging.DEBUG, logging.DEBUG]
    for name in sorted(OWN):
        level, text = lines(event(name, rank=1), logging.WARNING)[0]
        assert level == logging.WARNING and text.startswith("[rank 1] "), name
    failed = lines(event("exit", rank=1, reason="failed", code=1), logging.INFO)[0]
    assert failed == (logging.INFO, "[rank 1] Exiting at step 87: failed (exit code 1).")


def test_the_sentences_people_read():
    assert sentence(event("stall", rank=1)) == (
        "[rank 1] Stalled 62.0 s at step 87 (ACCUMULATE) in the step-end signal agreement (all-reduce)."
    )
    saved = event("checkpoint_saved", asynchronous=False, sharded=False, path="runs/qs/checkpoints/100")
    assert sentence({**saved, "pruned": ["runs/qs/checkpoints/80"]}) == (
        "Saved checkpoint 100 (1.3 MB in 7.8 ms): runs/qs/checkpoints/100; removed 80."
    )
    assert sentence({**saved, "path": f"{LONG}/100", "pruned": None}) == (
        "Saved checkpoint 100 (1.3 MB in 7.8 ms): .../a-rather-long-run-name-2026-11-27/checkpoints/100."
    )
    assert sentence(event("non_finite")) == "Non-finite gradients at step 87: running the step again (retry 1 of 3)."
    assert sentence(event("signal_agreed")) == "Stopping at step 3 (SIGUSR1): a checkpoint, then exit."
    assert sentence(event("exit", reason="completed", code=0)) == "Done: completed at step 87 (exit code 0)."
    assert sentence(event("data_exhausted")) == (
        "The data is used up after 3 epochs (max_epochs): the run ends, 1 micro-batch unstepped."
    )
    assert str(sentence(event("data_resumed"))).startswith("The data resumes in epoch 6 after 16 batches ")


def test_one_line_per_checkpoint_and_the_trail_unchanged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainfsm")
    TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[CheckpointingHook(interval=2, keep_previous=0)]).train()
    said = [r.getMessage() for r in caplog.records if r.name == "trainfsm"]
    saves = [line for line in said if line.startswith("Saved checkpoint")]
    assert [line.split(" (")[0] for line in saves] == ["Saved checkpoint 2", "Saved checkpoint 4", "Saved checkpoint 6"]
    assert saves[1].endswith("; removed 2.") and saves[2].endswith("; removed 4.")
    assert all(len(line) <= WIDTH and "checksum" not in line for line in said)
    trail = read_events(tmp_path)
    assert [e["paths"] for e in trail if e["event"] == "checkpoint_pruned"] == [
        [str(tmp_path / "checkpoints" / "2")],
        [str(tmp_path / "checkpoints" / "4")],
    ]
    assert not [e for e in trail if "console" in e or "pruned" in e]  # the console's field stays out of the trail
