"""What a replay gives (``trainfsm.tools.replay``): a ``RankAttempt``, what one rank did in one
attempt, and the ``Problem`` s found on the way, each pointing at the line that shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainfsm import machine as fsm
from trainfsm.tools.ledger_count import DataCount


@dataclass(frozen=True, slots=True)
class Problem:
    """One inconsistency, or one way the run did not end well, pointing at the line that shows it."""

    kind: str
    message: str
    file: str | None = None
    line: int | None = None
    rank: int | None = None
    attempt: int | None = None

    def where(self) -> str:
        if self.file is None:
            return ""
        return f"{self.file}:{self.line}" if self.line is not None else self.file

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "file": self.file,
            "line": self.line,
            "rank": self.rank,
            "attempt": self.attempt,
        }


@dataclass(slots=True)
class RankAttempt:
    """What one rank did in one attempt, as replayed from its trail."""

    rank: int
    attempt: int
    file: str
    run_id: str | None = None
    world_size: int | None = None
    torchelastic: dict[str, Any] | None = None  # run_start's: torchrun's restart count, max restarts
    events: int = 0
    start: str | None = None
    resumed_from_step: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    steps_done: int = 0
    micro_batches: int = 0
    loss_none: int = 0
    loss_none_at: list[str] = field(default_factory=list)  # "step S micro M" of each skipped micro-batch
    retries: list[dict[str, Any]] = field(default_factory=list)
    scaler_skips: list[int] = field(default_factory=list)
    ooms: list[dict[str, Any]] = field(default_factory=list)  # out-of-memory retries: step, pieces, phase, micro
    checkpoint_steps: list[int] = field(default_factory=list)
    saved: list[dict[str, Any]] = field(default_factory=list)
    loaded: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    agreed: dict[str, Any] | None = None
    exceptions: list[dict[str, Any]] = field(default_factory=list)
    requeue: dict[str, Any] | None = None
    requeue_line: int | None = None
    exit: dict[str, Any] | None = None
    exit_line: int | None = None
    format: int | None = None  # run_start's trail format
    # The data ledger (``trainfsm.tools.ledger``): where this rank's data stood, counted from the trail.
    data: DataCount = field(default_factory=DataCount)
    not_loaded: bool = False  # CheckpointingHook(load=None): a fresh start asked for
    stalls: list[dict[str, Any]] = field(default_factory=list)  # each stall (its first report), cleared or not
    # The last stall, while the rank did not move on from it: no stall_cleared followed it, or its
    # collective failed (``ended``: the rank left it by failing, not by going on).
    stall_open: dict[str, Any] | None = None
    # A preemption's times (``trainfsm.tools.preemption_timing``): run_start's job end, the step's
    # end and the agreement (signal_agreed), the deadline's figures, job_end, the exit's ts.
    timing: dict[str, Any] = field(default_factory=dict)
    # DDP's bucket layout (``trainfsm.ddp_buckets``): why this attempt's differs from the saved one's.
    buckets_problem: str | None = None
    end_state: str = fsm.BUILD
    end_step: int = 0
    end_line: int = 0
    started_at: float = 0.0
    ended_at: float = 0.0
    previous_at: float | None = None  # the time of the record before the last one
