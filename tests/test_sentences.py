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
from trainfsm.trail.schema import EVENT_FIELDS
from trainfsm.trail.sentences import SENTENCES

CHECKSUM = "67fce2c38ba4205e84536bd884e49244"
LONG = "/scratch/project/someone/experiments/a-rather-long-run-name-2026-11-27/checkpoints"
RATES = {"probe": {"page_cache": 5.5, "o_direct": 4.7}, "saves": {"page_cache": None, "o_direct": None}}

#: One event of each kind, with the fields a run writes (values as a real trail has them).
SAMPLES: dict[str, dict[str, Any]] = {
    "run_start": {
        "format": 4,
        "versions": {"trainfsm": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7"},
        "world_size": 2,
        "max_steps": 200,
        "config": {"grad_clip": 1.0},
        "signals": {"ignored": [], "blocked": [], "pending": []},
        "torchelastic": None,
        "trail": {"form": "compact", "flush_seconds": 0.5, "segment_bytes": 67108864},
    },
    "transition": {"trigger": "micro", "source": "STEP", "dest": "ACCUMULATE"},
    "steps": {"first": 2, "micro": 1, "dt": [2330, 2100]},
    "restore": {"resumed": False, "from_step": 0},
    "data_layout": {"order": "distributed", "why": None, "world_size": 2, "rank": 0, "batch_size": 32},
    "epoch": {"epoch": 3, "fingerprint": "8612aac267b46632"},
    "data_resumed": {
        "mode": "sampler",
        "why": "map-style DataLoader: the used indices are skipped at its sampler, nothing is loaded",
        "epoch": 6,
        "batches": 16,
        "positioned": 16,
        "seconds": 0.00061,
        "from_step": 200,
        "from_world_size": 1,
        "global": {"epoch": 6, "samples": 512},
        "exact": True,
        "approximate": None,
        "rng": "this rank's own",
    },
    "batch_fingerprint": {"after": "save", "from_step": 100, "epoch": 3, "batches": 9, "fingerprint": "8612aac2"},
    "data_exhausted": {"epochs": 3, "dropped_micro_batches": 1},
    "metrics": {"values": {"train/loss": 0.25, "train/lr/0": 0.001}},
    "loss_none": {"micro": 1, "ranks": [1]},
    "non_finite": {"what": "gradients", "retry": 1, "max": 3, "scale": None},
    "oom": {
        "micro": 2,
        "phase": "backward",
        "rows": 32,
        "pieces": 2,
        "piece_rows": 16,
        "replays": 1,
        "retry": 1,
        "max": 3,
        "ranks": [0, 1],
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)",
    },
    "checkpoint_saved": {
        "path": f"{LONG}/100",
        "saved_step": 100,
        "bytes": 1254175,
        "seconds": 0.007827,
        "checksum": CHECKSUM,
        "kept": False,
        "asynchronous": True,
        "blocked_seconds": 0.003,
        "sharded": True,
        "world_size": 8,
        "direct_io": False,
        "chosen_by": "measurement",
        "rates": RATES,
        "data": {"epoch": 3, "batches": 8},
        "pruned": [f"{LONG}/80", f"{LONG}/90"],  # the console's alone (``CONSOLE_ONLY``)
    },
    "checkpoint_loaded": {
        "path": f"{LONG}/200",
        "from_step": 200,
        "sharded": False,
        "format": "trainloop",
        "checksum": CHECKSUM,
    },
    "checkpoint_not_loaded": {"reason": "load=None"},
    "ddp_buckets": {"action": "not_primed", "module": "", "reason": "the model changed since the checkpoint"},
    "checkpoint_skipped": {"path": f"{LONG}/300", "reason": f"checksum mismatch: manifest.json {CHECKSUM}"},
    "checkpoint_foreign": {"found": {"8": "trainloop", "notes": "unknown"}},
    "checkpoint_not_newest": {"path": f"{LONG}/4", "from_step": 4, "newest": f"{LONG}/8", "newest_step": 8},
    "checkpoint_pruned": {"paths": [f"{LONG}/100"]},
    "checkpoint_tmp_removed": {"names": [".tmp-300-1a2b"]},
    "checkpoint_tmp_completed": {"names": [".tmp-300-1a2b"]},
    "checkpoint_store_ready": {"seconds": 0.2, "direct_io": False, "chosen_by": "measurement", "rates": RATES},
    "checkpoint_room_reserved": {"bytes": 2 << 20, "allocated": 0, "seconds": 0.01, "complete": True},
    "checkpoint_failed": {"type": "OSError", "message": "[Errno 28] No space left on device: '/scratch/ckpt'"},
    "signal_received": {"signal": "SIGUSR1", "received_at": 1795804573.07, "at_step": 2, "at_state": "STEP"},
    "signal_agreed": {"signal": "SIGUSR1", "agreed_step": 3, "reason": "signal", "step_ended_at": 1795804573.08},
    "deadline": {
        "end_time": 1795804673.0,
        "decided_at": 1795804573.0,
        "left": 100.0,
        "needed": 95.5,
        "steps": 2,
        "step_seconds": 1.5,
        "save_seconds": 2.5,
        "save_measured": True,
        "write_seconds": 0.0,
        "exit_seconds": 1.0,
        "margin": 60.0,
    },
    "job_end": {
        "end_time": 1795804673.0,
        "read_at": 1795804573.0,
        "after": "signal",
        "applied": "grace_time",
        "kill_start": 1795804600.0,
        "kill_wait": 30,
        "kill_at": 1795804630.0,
        "job_state": "RUNNING",
        "restarts": 0,
    },
    "preempted": {
        "preempt_time": 1795804573.0,
        "grace_end": 1795804603.0,
        "grace_time": 30,
        "mode": "REQUEUE",
        "read_at": 1795804574.0,
        "noticed_at": 1795804574.1,
    },
    "signal_passed_on": {
        "signal": "SIGHUP",
        "received_at": 1795804573.0,
        "at_state": "BUILD",
        "disposition": "default",
    },
    "signals_not_installed": {"reason": "train() is not running in the main thread"},
    "launcher_stop": {"pid": 4242, "signal": "SIGTERM", "at": "process exit"},
    "restart_stop": {"signal": "SIGTERM"},
    "requeue": {"command": "scontrol requeue 1234", "ok": True, "message": "", "requeued_by": "trainer"},
    "wandb_run": {"wandb_id": "3kd92jf0", "continued": True, "mode": "online"},
    "early_stop": {"monitor": "val/loss", "best": 0.123, "best_step": 400, "bad_evaluations": 5, "patience": 5},
    "cuda_memory_unavailable": {"device": "cpu"},
    "collective_failed": {
        "note": "trainfsm: rank 0 of 2 failed in a collective at step 5 (STEP): rank 1 probably raised an "
        "exception or died. gloo notices a peer process that exited at once; ...",
        "trails": ["runs/ddp/logs/events.rank1.jsonl"],
    },
    "group_outlives_destroy": {"cause": "trainfsm was imported after the default group was created"},
    "stall": {
        "micro": 1,
        "seconds": 62.0,
        "budget": 30.0,
        "report": 1,
        "action": "record",
        "doing": "the step-end signal agreement (all-reduce)",
        "collective": "the step-end signal agreement (all-reduce)",
        "hook": None,
        "stack": ["trainer.py:400 _step", "collectives.py:120 result"],
        "by": "watchdog",
    },
    "stall_cleared": {
        "seconds": 62.5,
        "reports": 1,
        "stalled_state": "ACCUMULATE",
        "stalled_step": 87,
        "by": "watchdog",
    },
    "exception": {"type": "RuntimeError", "message": "Step 5: gradients were non-finite " * 5, "traceback": "..."},
    "exit": {"reason": "preempted", "code": 138},
}


#: Events whose sentence quotes free text (an error's message): cut to fit.
FREE_TEXT = {"exception", "checkpoint_failed", "checkpoint_skipped", "collective_failed"}


def event(name: str, rank: int = 0, **fields: Any) -> dict[str, Any]:
    common = {"ts": 1795804573.0, "event": name, "rank": rank, "run_id": "9361988b6c96", "attempt": 1}
    return {**common, "step": 87, "state": "CHECKPOINT", **SAMPLES[name], **fields}


def test_every_event_kind_of_the_schema_has_a_sentence_or_is_the_trails_alone():
    assert list(SENTENCES) == list(EVENT_FIELDS)  # the same kinds, in the schema's order
    assert SAMPLES.keys() == EVENT_FIELDS.keys()


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
        "[rank 1] Stalled 62.0 s at step 87 (CHECKPOINT) in the step-end signal agreement (all-reduce)."
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
