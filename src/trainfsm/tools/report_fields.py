"""The audit's JSON form (``trainfsm audit --json``, ``trainfsm.tools.report``'s schema): the fields
of a rank's attempt and of a stall, as ``AttemptReport.as_dict`` lists them."""

from __future__ import annotations

from typing import Any

from trainfsm.tools.rank_attempt import RankAttempt


def stall_dict(stall: dict[str, Any]) -> dict[str, Any]:
    keys = ("rank", "state", "step", "seconds", "reports", "doing", "collective", "hook", "at", "cleared", "ended")
    return {key: stall.get(key) for key in keys}


def rank_dict(r: RankAttempt) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "file": r.file,
        "run_id": r.run_id,
        "world_size": r.world_size,
        "events": r.events,
        "first_step": r.first_step,
        "last_step": r.last_step,
        "steps_done": r.steps_done,
        "micro_batches": r.micro_batches,
        "retry_steps": [x["step"] for x in r.retries],
        "checkpoint_steps": r.checkpoint_steps,
        "loaded_step": r.loaded[-1]["step"] if r.loaded else None,
        "agreed_step": r.agreed["step"] if r.agreed else None,
        "exit": r.exit,
        "end": {"state": r.end_state, "step": r.end_step},
        "started_at": r.started_at,
        "ended_at": r.ended_at,
    }
