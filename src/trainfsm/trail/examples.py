"""One real example of each event kind of the schema, with the fields a run writes (values as a
real trail has them), beside the sentences they render: the event reference shows what the console
prints of each (``scripts/docs_hooks.py``), and ``tests/test_sentences.py`` renders every kind.

Some values are long on purpose (a path deep under ``/scratch``, an error's message): the console
must fit them in one line. No torch and no structlog here.
"""

from __future__ import annotations

from typing import Any, Final

CHECKSUM: Final = "67fce2c38ba4205e84536bd884e49244"
LONG: Final = "/scratch/project/someone/experiments/a-rather-long-run-name-2026-11-27/checkpoints"
RATES: Final = {"probe": {"page_cache": 5.5, "o_direct": 4.7}, "saves": {"page_cache": None, "o_direct": None}}

#: Event name -> the fields of one example of it (``example`` adds the common ones).
FIELDS: Final[dict[str, dict[str, Any]]] = {
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
    "exception": {
        "type": "RuntimeError",
        "message": "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        "(when checking argument for argument mat1 in method wrapper_CUDA_addmm)",
        "traceback": "Traceback (most recent call last): ...",
    },
    "exit": {"reason": "preempted", "code": 138},
}


#: The fields every event carries, as one mid-run event has them.
COMMON: Final[dict[str, Any]] = {"ts": 1795804573.0, "rank": 0, "run_id": "9361988b6c96", "attempt": 1, "step": 87}


def example(name: str, **fields: Any) -> dict[str, Any]:
    """The example of event ``name`` as the trail holds it, ``fields`` changed."""
    state = "CHECKPOINT" if name.startswith("checkpoint_") else "ACCUMULATE"
    return {**COMMON, "event": name, "state": state, **FIELDS[name], **fields}
