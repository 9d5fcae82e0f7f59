"""The audit trail's schema: what the runtime writes and the offline tools read.

One JSON object per line, per rank, in ``WORKSPACE/logs/events.rank{R}.jsonl`` (rotated into
segments: ``trainfsm.segments``). Every event carries ``ts`` (seconds since the epoch),
``event``, ``rank``, ``step``, ``state``, ``run_id`` and ``attempt``; ``EVENT_FIELDS`` lists each
event's own fields. The writer is ``trainfsm.events``, the reader ``trainfsm.trail``. No torch and
no structlog here: the offline commands import this.
"""

from __future__ import annotations

import uuid
from typing import Any, Final

from trainfsm.machine import ExitReason

#: 2: routine steps are written as compact ``steps`` records (1: every transition verbatim).
#: The readers take both.
FORMAT_VERSION: Final = 2
READABLE_FORMATS: Final = (1, 2)

#: Event name -> the fields it adds to the common ones. Decision events are INFO for people.
EVENT_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "run_start": ("format", "versions", "world_size", "max_steps", "config", "signals", "torchelastic", "trail"),
    "transition": ("trigger", "source", "dest"),
    # Routine steps first..step (``step`` is the last), each ``micro`` micro-batches long: ``ts`` is
    # the last step's end, ``dt`` each step's duration in integer microseconds (from the previous
    # step's end; the first's from its own start, which is ``ts`` less the sum of ``dt``).
    "steps": ("first", "micro", "dt"),
    "restore": ("resumed", "from_step"),
    "epoch": ("epoch",),
    "data_resumed": ("mode", "why", "epoch", "batches", "positioned", "seconds"),
    "data_exhausted": ("epochs", "dropped_micro_batches"),
    "metrics": ("values",),
    "loss_none": ("micro", "ranks"),
    "non_finite": ("what", "retry", "max", "scale"),
    "checkpoint_saved": (
        "path",
        "saved_step",
        "bytes",
        "seconds",
        "checksum",
        "kept",
        "asynchronous",
        "sharded",
        "direct_io",
    ),
    "checkpoint_loaded": ("path", "from_step", "sharded"),
    "checkpoint_skipped": ("path", "reason"),
    "checkpoint_pruned": ("paths",),
    "checkpoint_tmp_removed": ("names",),
    "checkpoint_store_ready": ("seconds",),
    "checkpoint_failed": ("type", "message"),
    "signal_received": ("signal", "received_at", "at_step", "at_state"),
    "signal_agreed": ("signal", "agreed_step"),
    "signal_passed_on": ("signal", "received_at", "at_state", "disposition"),
    "requeue": ("command", "ok", "message"),
    "wandb_run": ("wandb_id", "continued", "mode"),
    "early_stop": ("monitor", "best", "best_step", "bad_evaluations", "patience"),
    "cuda_memory_unavailable": ("device",),
    "collective_failed": ("note", "trails"),
    "group_outlives_destroy": ("cause",),
    "exception": ("type", "message", "traceback"),
    "exit": ("reason", "code"),
}

#: The trail's forms: routine steps as ``steps`` records, or every transition verbatim (debugging).
TRAIL_FORMS: Final = ("compact", "full")

#: The ``exit`` event's reasons (``trainer.exit_reason``).
EXIT_REASONS: Final = tuple(reason.value for reason in ExitReason)


def transition_event(
    ts: float, step: int, trigger: str, source: str, dest: str, common: dict[str, Any]
) -> dict[str, Any]:
    """A transition as the trail holds it (``common``: rank, run_id, attempt)."""
    return {
        "ts": ts,
        "event": "transition",
        **common,
        "step": step,
        "state": dest,
        "trigger": trigger,
        "source": source,
        "dest": dest,
    }


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
