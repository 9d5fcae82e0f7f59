"""``trainfsm audit``: replay a run's audit trail against the machine's table and say what happened.

The trail is replayed per rank and attempt (an attempt is one process lifetime: a launch or a
restart; ranks of one launch share its number). Each attempt starts in BUILD; every transition's
source must be the state the replay is in and (trigger, source, dest) must be a row of
``trainfsm.machine.transition_rows()``. Every event also carries the trainer's step and state at
the moment it was written, which the replay checks against its own:

- the trainer advances ``step`` on entering STEP, so a transition into STEP records the old step
  and everything after it the new one: step numbers rise by exactly one per step;
- in RESTORE the step may jump to the restored checkpoint's step (``checkpoint_loaded``); the
  ``restore`` event states where training resumes (``from_step``, 0 for a fresh start), so the first
  step of an attempt is ``from_step + 1``.

Transitions are written in batches, always before the next other event, so a process killed with
SIGKILL may lose the transitions after its last decision event: the trail is then a clean prefix of
what happened. Such an attempt has no ``exit`` event: it is reported as killed at its last record
(step, state, and the time since the record before it), and its missing tail is not an illegal
transition.

Two questions get two answers. Is the trail consistent with the machine? ``problems`` (any makes
it inconsistent: ``trainfsm audit`` exits 3). Did the run end well? ``run_problems`` (any: exit 1,
when the trail is consistent). A run problem is about the last attempt only, as a later attempt
means the run went on (it was resumed or restarted), by ``kind``:

- ``failed``: the last attempt exited ``failed`` (an exception; the code is the process's status);
- ``interrupted``: the last attempt exited ``interrupted`` (Ctrl-C: KeyboardInterrupt, code 130);
- ``killed``: the last attempt has no ``exit`` event on some rank (SIGKILL, out of memory, a lost
  node): reported at that rank's last record;
- ``requeue_refused``: the last attempt's ``scontrol requeue`` failed (``requeue`` with ok=false,
  the message says why): nothing will resume the run.

Consistency problems, by ``kind``:

- ``illegal_transition``: a transition that is not a row of the table, or whose source is not the
  replayed state;
- ``state_mismatch``: an event written in another state than the replay is in (a lost line);
- ``gap``: a step number that jumps, or an attempt that does not start at its checkpoint's step + 1;
- ``rank_disagreement``: ranks of one attempt that differ in steps done, retry steps, checkpoint
  steps, restored step, agreed signal step, or exit reason/code (compared only when every rank has
  its exit event: a killed rank's tail is not evidence);
- ``malformed``: events out of order (after ``exit``, an attempt number going back, an unknown exit
  reason).

``--json`` prints one object (schema ``trainfsm.audit/1``; fields are only ever added)::

    {"schema": "trainfsm.audit/1",
     "consistent": bool,                      # true iff "problems" is empty (else exit code 3)
     "ended_well": bool,                      # true iff "run_problems" is empty (else exit code 1)
     "files": [{"path": str, "ranks": [int], "events": int}],
     "attempts": [{                           # by attempt number
        "attempt": int,
        "ranks": [int],
        "start": "launch" | "resume" | null,  # null: ended before RESTORE said
        "resumed_from_step": int | null,
        "first_step": int | null, "last_step": int | null,   # first begun, last completed
        "steps_done": int,                    # optimizer steps completed in this attempt
        "micro_batches": int,                 # forward/backward passes begun (entries into ACCUMULATE)
        "loss_none": int,                     # micro-batches whose forward returned loss=None
        "retries": [{"step": int, "retry": int}],   # non-finite gradients: the step ran again
        "scaler_skips": [int],                # steps whose optimizer step the fp16 scaler skipped
        "checkpoint_steps": [int],            # steps after which the machine entered CHECKPOINT
        "checkpoints": {
          "saved":   [{"step": int, "path": str, "kept": bool, "asynchronous": bool, "bytes": int}],
          "loaded":  [{"step": int, "path": str}],
          "skipped": [{"path": str, "reason": str}],
          "failed":  [{"type": str, "message": str}]},
        "signals": {
          "received": [{"rank": int, "signal": str, "at_step": int|null, "at_state": str|null, "ts": float}],
          "agreed": {"signal": str, "step": int} | null},
        "exceptions": [{"rank": int, "type": str, "message": str, "file": str, "line": int}],
        "requeue": {"ok": bool, "command": str|null, "message": str} | null,
        "exit": {"reason": str, "code": int} | null,   # null: no exit event on the first rank
        "ended": str,                         # how each rank ended: "rank 0 killed (...), rank 1 failed (...)"
        "torchelastic": {"restart_count": int, "max_restarts": int|null, "run_id": str|null} | null,
        "killed": bool,                       # some rank has no exit event
        "killed_at": [{"rank": int, "file": str, "line": int, "state": str, "step": int,
                       "ts": float, "since_previous": float | null}],   # each such rank's last record
        "end": {"state": str, "step": int},   # where the first rank's trail of this attempt ends
        "started_at": float, "ended_at": float,       # epoch seconds, all ranks
        "per_rank": [{"rank", "file", "run_id", "world_size", "events", "first_step", "last_step",
                      "steps_done", "micro_batches", "retry_steps", "checkpoint_steps",
                      "loaded_step", "agreed_step", "exit", "end", "started_at", "ended_at"}]}],
     "problems": [{"kind": str, "message": str, "file": str|null, "line": int|null,
                   "rank": int|null, "attempt": int|null}],
     "run_problems": [...],                   # as "problems", kinds of RUN_PROBLEM_KINDS
     "notes": [{"message": str, "file": str|null, "line": int|null}]}

Attempt-level values are those of the attempt's lowest rank, except ``checkpoints.saved``,
``skipped`` and ``failed`` (rank 0 writes checkpoints), ``signals.received`` and ``exceptions``,
which gather all ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from trainfsm import machine as fsm
from trainfsm import segments
from trainfsm.events import EXIT_REASONS
from trainfsm.trail import Note, Record, Trail, TrailError, open_trail, read_records

SCHEMA: Final = "trainfsm.audit/1"
PROBLEM_KINDS: Final = (
    "illegal_transition",
    "state_mismatch",
    "gap",
    "rank_disagreement",
    "malformed",
)
RUN_PROBLEM_KINDS: Final = ("failed", "interrupted", "killed", "requeue_refused")

#: The machine's table as the trainer runs it: (trigger, source, dest) rows.
_TABLE: Final = frozenset(fsm.transition_rows())

#: Triggers that leave ACCUMULATE with the optimizer step applied (or skipped by the scaler).
_STEP_DONE: Final = frozenset({"stepped", "save", "finish"})


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
    end_state: str = fsm.BUILD
    end_step: int = 0
    end_line: int = 0
    started_at: float = 0.0
    ended_at: float = 0.0
    previous_at: float | None = None  # the time of the record before the last one


class _Replay:
    """Folds one rank's events of one attempt into a ``RankAttempt``, recording problems on the way.

    ``state`` and ``step`` are the machine's state and the trainer's step as the replay has them;
    each event is checked against them, then applied.
    """

    def __init__(self, first: Record, problems: list[Problem], origin: str = "") -> None:
        self.origin = origin  # the rank trail (all its segments) the attempt was read from
        self.result = RankAttempt(rank=first.rank, attempt=first.attempt, file=first.file, started_at=first.ts)
        self.problems = problems
        self.state = fsm.BUILD
        self.step = 0

    def problem(self, kind: str, record: Record, message: str) -> None:
        self.problems.append(Problem(kind, message, record.file, record.line, record.rank, record.attempt))

    def feed(self, record: Record) -> None:
        result = self.result
        if result.exit is not None:
            self.problem("malformed", record, f"{record.name} after the exit event of attempt {record.attempt}")
        if result.events:
            result.previous_at = result.ended_at  # a killed attempt: how long since the record before
        result.events += 1
        result.ended_at = record.ts
        result.end_line = record.line
        name = record.name
        if name == "steps":
            self._steps(record)
        elif name == "transition":
            self._transition(record)
        else:
            self._check_position(record)
            handler = _HANDLERS.get(record.name)
            if handler is not None:
                handler(self, record)
        result.end_state, result.end_step = self.state, self.step

    # ---------------------------------------------------------------- checks
    def _check_step(self, record: Record) -> None:
        if record.step == self.step or self.state == fsm.RESTORE:
            self.step = record.step  # RESTORE: the restored checkpoint's step arrives here
            return
        expected = self.step
        missing = f" (step {expected} missing)" if record.step == expected + 1 else ""
        self.problem("gap", record, f"step jumps from {expected} to {record.step}{missing}")
        self.step = record.step

    def _check_position(self, record: Record) -> None:
        self._check_step(record)
        if record.state != self.state:
            self.problem(
                "state_mismatch",
                record,
                f"{record.name} was written in {record.state}, but the replay is in {self.state} "
                f"(a transition line is missing?)",
            )
            self.state = record.state

    # ---------------------------------------------------------------- transitions
    def _transition(self, record: Record) -> None:
        data = record.data
        trigger, source, dest = data["trigger"], data["source"], data["dest"]
        if source != self.state:
            self.problem(
                "illegal_transition",
                record,
                f"{trigger}: {source} -> {dest} taken while the machine was in {self.state}",
            )
        elif (trigger, source, dest) not in _TABLE:
            self.problem("illegal_transition", record, f"{trigger}: {source} -> {dest} is not a row of the machine")
        if trigger in fsm.STEP_TAKEN_BACK:
            self._step_never_happened()
        self._check_step(record)
        if record.state != dest:
            self.problem("state_mismatch", record, f"a transition to {dest} written in state {record.state}")
        self._count(trigger, source, dest)
        self.state = dest
        if dest == fsm.STEP:  # the trainer advances its step on entering STEP, after this line
            self.step += 1
            if self.result.first_step is None:
                self._check_first_step(record)
                self.result.first_step = self.step

    def _steps(self, record: Record) -> None:
        self.steps(record.data, record.file, record.line, counted=True)

    def steps(self, data: dict[str, Any], file: str, line: int, counted: bool = False) -> None:
        """A compact run of routine steps first..step: each is ``fsm.ROUTINE_START``, ``micro - 1``
        x ``fsm.ROUTINE_NEXT``, ``fsm.ROUTINE_END``, replayed at once (they are rows of the table,
        checked at import), so auditing costs the same per record however many steps it holds.
        Called with the record's dict straight from the reader (``counted``: ``feed`` did the
        bookkeeping already); a ``Record`` is made only to point a problem at the line."""
        result = self.result
        if not counted:
            if result.exit is not None:
                self.feed(Record(file, line, data))  # says what is wrong, then replays it
                return
            if result.events:
                result.previous_at = result.ended_at
            result.events += 1
            result.ended_at = data["ts"]
            result.end_line = line
        first, last, micro = data["first"], data["step"], data["micro"]
        if self.state != fsm.STEP or first != self.step or data["state"] != fsm.STEP:
            self._steps_problems(Record(file, line, data), first, last)
        count = last - first + 1
        result.micro_batches += count * micro
        result.steps_done += count
        result.last_step = last
        self.state = fsm.STEP
        self.step = last + 1
        if result.first_step is None:  # a trail that begins mid-attempt
            result.first_step = first
        result.end_state, result.end_step = fsm.STEP, self.step

    def _steps_problems(self, record: Record, first: int, last: int) -> None:
        if self.state != fsm.STEP:
            trigger, source, dest = fsm.ROUTINE_START
            self.problem(
                "illegal_transition",
                record,
                f"{trigger}: {source} -> {dest} (routine steps {first}-{last}) taken while the machine was in "
                f"{self.state}",
            )
        if first != self.step:
            missing = f" (step {self.step} missing)" if first == self.step + 1 else ""
            self.problem("gap", record, f"step jumps from {self.step} to {first}{missing}")
        if record.state != fsm.STEP:
            self.problem("state_mismatch", record, f"routine steps ending in STEP written in state {record.state}")

    def _step_never_happened(self) -> None:
        """A trigger of ``fsm.STEP_TAKEN_BACK`` (``max_epochs`` ran out): the step that began is taken back."""
        self.step -= 1
        if self.result.first_step == self.step + 1:
            self.result.first_step = None

    def _check_first_step(self, record: Record) -> None:
        base = self.result.resumed_from_step or 0
        if self.step != base + 1:
            where = f"the checkpoint of step {base}" if base else "a fresh start"
            self.problem("gap", record, f"the first step is {self.step}, but after {where} it must be {base + 1}")

    def _count(self, trigger: str, source: str, dest: str) -> None:
        result = self.result
        if dest == fsm.ACCUMULATE:
            result.micro_batches += 1
        if source == fsm.ACCUMULATE and trigger in _STEP_DONE:
            result.steps_done += 1
            result.last_step = self.step
        if dest == fsm.CHECKPOINT:
            result.checkpoint_steps.append(self.step)

    # ---------------------------------------------------------------- other events
    def _run_start(self, record: Record) -> None:
        data = record.data
        self.result.run_id = str(data.get("run_id", ""))  # also marks that run_start was seen
        self.result.world_size = data.get("world_size")
        elastic = data.get("torchelastic")
        self.result.torchelastic = elastic if isinstance(elastic, dict) else None

    def _restore(self, record: Record) -> None:
        data = record.data
        result = self.result
        resumed = bool(data.get("resumed"))
        from_step = data.get("from_step")
        result.start = "resume" if resumed else "launch"
        result.resumed_from_step = from_step if resumed else None
        loaded = [entry["step"] for entry in result.loaded]
        if loaded and loaded[-1] != from_step:
            self.problem("gap", record, f"restore says from_step {from_step}, the checkpoint loaded was {loaded[-1]}")
        elif not resumed and from_step:
            self.problem("gap", record, f"a fresh start (resumed=false) at step {from_step}")

    def _checkpoint_saved(self, record: Record) -> None:
        data = record.data
        self.result.saved.append(
            {
                "step": data.get("saved_step"),
                "path": data.get("path"),
                "kept": data.get("kept"),
                "asynchronous": data.get("asynchronous"),
                "bytes": data.get("bytes"),
            }
        )

    def _checkpoint_loaded(self, record: Record) -> None:
        self.result.loaded.append({"step": record.data.get("from_step"), "path": record.data.get("path")})

    def _checkpoint_skipped(self, record: Record) -> None:
        self.result.skipped.append({"path": record.data.get("path"), "reason": record.data.get("reason")})

    def _checkpoint_failed(self, record: Record) -> None:
        self.result.failed.append({"type": record.data.get("type"), "message": record.data.get("message")})

    def _non_finite(self, record: Record) -> None:
        if record.data.get("what") == "scaler_skip":
            self.result.scaler_skips.append(record.step)
        else:
            self.result.retries.append({"step": record.step, "retry": record.data.get("retry")})

    def _loss_none(self, record: Record) -> None:
        self.result.loss_none += 1
        self.result.loss_none_at.append(f"step {record.step} micro {record.data.get('micro')}")

    def _signal_received(self, record: Record) -> None:
        data = record.data
        self.result.received.append(
            {
                "rank": record.rank,
                "signal": data.get("signal"),
                "at_step": data.get("at_step"),
                "at_state": data.get("at_state"),
                "ts": data.get("received_at", record.ts),
            }
        )

    def _signal_agreed(self, record: Record) -> None:
        self.result.agreed = {"signal": record.data.get("signal"), "step": record.data.get("agreed_step")}

    def _exception(self, record: Record) -> None:
        data = record.data
        self.result.exceptions.append(
            {
                "rank": record.rank,
                "type": data.get("type"),
                "message": data.get("message"),
                "file": record.file,
                "line": record.line,
            }
        )

    def _requeue(self, record: Record) -> None:
        data = record.data
        self.result.requeue = {"ok": data.get("ok"), "command": data.get("command"), "message": data.get("message")}
        self.result.requeue_line = record.line

    def _exit(self, record: Record) -> None:
        reason = record.data.get("reason")
        if reason not in EXIT_REASONS:
            self.problem("malformed", record, f"unknown exit reason {reason!r} (known: {', '.join(EXIT_REASONS)})")
        self.result.exit = {"reason": reason, "code": record.data.get("code")}
        self.result.exit_line = record.line


_HANDLERS: Final = {
    "run_start": _Replay._run_start,
    "restore": _Replay._restore,
    "checkpoint_saved": _Replay._checkpoint_saved,
    "checkpoint_loaded": _Replay._checkpoint_loaded,
    "checkpoint_skipped": _Replay._checkpoint_skipped,
    "checkpoint_failed": _Replay._checkpoint_failed,
    "non_finite": _Replay._non_finite,
    "loss_none": _Replay._loss_none,
    "signal_received": _Replay._signal_received,
    "signal_agreed": _Replay._signal_agreed,
    "exception": _Replay._exception,
    "requeue": _Replay._requeue,
    "exit": _Replay._exit,
}


# -------------------------------------------------------------------- the report
@dataclass(slots=True)
class AttemptReport:
    """One attempt over all its ranks."""

    attempt: int
    ranks: list[RankAttempt]

    @property
    def first(self) -> RankAttempt:
        return self.ranks[0]

    @property
    def killed(self) -> bool:
        return any(r.exit is None for r in self.ranks)

    def killed_at(self) -> list[dict[str, Any]]:
        """Where each rank without an exit event stopped: its last record, and how long after the
        record before it (a long pause there: it hung before it was killed)."""
        return [
            {
                "rank": r.rank,
                "file": r.file,
                "line": r.end_line,
                "state": r.end_state,
                "step": r.end_step,
                "ts": r.ended_at,
                "since_previous": None if r.previous_at is None else r.ended_at - r.previous_at,
            }
            for r in self.ranks
            if r.exit is None
        ]

    def ended(self) -> str:
        """How the ranks' attempt ended, in words, ranks that ended alike together:
        ``ranks 0-6 completed (code 0); rank 7 killed (...)``."""
        groups = _group(self.ranks, _how_ended).items()
        return "; ".join(f"{_who([r.rank for r in ranks])} {how}" for how, ranks in groups)

    def as_dict(self) -> dict[str, Any]:
        first = self.first
        return {
            "attempt": self.attempt,
            "ranks": [r.rank for r in self.ranks],
            "start": first.start,
            "resumed_from_step": first.resumed_from_step,
            "first_step": first.first_step,
            "last_step": first.last_step,
            "steps_done": first.steps_done,
            "micro_batches": first.micro_batches,
            "loss_none": first.loss_none,
            "retries": first.retries,
            "scaler_skips": first.scaler_skips,
            "checkpoint_steps": first.checkpoint_steps,
            "checkpoints": {
                "saved": [s for r in self.ranks for s in r.saved],
                "loaded": first.loaded,
                "skipped": [s for r in self.ranks for s in r.skipped],
                "failed": [s for r in self.ranks for s in r.failed],
            },
            "signals": {"received": [s for r in self.ranks for s in r.received], "agreed": first.agreed},
            "exceptions": [e for r in self.ranks for e in r.exceptions],
            "requeue": first.requeue,
            "exit": first.exit,
            "ended": self.ended(),
            "torchelastic": first.torchelastic,
            "killed": self.killed,
            "killed_at": self.killed_at(),
            "end": {"state": first.end_state, "step": first.end_step},
            "started_at": min(r.started_at for r in self.ranks),
            "ended_at": max(r.ended_at for r in self.ranks),
            "per_rank": [_rank_dict(r) for r in self.ranks],
        }


def _rank_dict(r: RankAttempt) -> dict[str, Any]:
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


@dataclass(slots=True)
class AuditReport:
    """The result of ``audit()``: attempts, problems (empty: consistent), notes, and run problems
    (empty: the run ended well)."""

    files: list[dict[str, Any]]
    attempts: list[AttemptReport]
    problems: list[Problem]
    notes: list[Note]
    run_problems: list[Problem] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return not self.problems

    @property
    def ended_well(self) -> bool:
        return not self.run_problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "consistent": self.consistent,
            "ended_well": self.ended_well,
            "files": self.files,
            "attempts": [a.as_dict() for a in self.attempts],
            "problems": [p.as_dict() for p in self.problems],
            "run_problems": [p.as_dict() for p in self.run_problems],
            "notes": [n.as_dict() for n in self.notes],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def audit(inputs: Iterable[Path], jobs: int | None = None) -> AuditReport:
    """Replay the trail of ``inputs`` (run directories and/or event files). ``TrailError`` when
    unreadable. ``jobs``: processes replaying rank files side by side (default: one per core)."""
    return audit_trail(open_trail(inputs), jobs=jobs)


#: Below this many bytes of trail, starting worker processes costs more than it saves.
PARALLEL_BYTES: Final = 32 << 20


def audit_trail(trail: Trail, observe: Callable[[Record], None] | None = None, jobs: int | None = None) -> AuditReport:
    """The replay proper; ``observe`` also sees every record (``trace`` collects its tails there,
    so the trail is read once).

    Each rank's file is replayed on its own (a rank's attempts are all in its file), so files are
    spread over ``jobs`` worker processes when the trail is large and nobody observes; what each
    returns is merged in file order, so the report is the same either way.
    """
    jobs = _jobs(jobs, trail) if observe is None else 1
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            parts = list(pool.map(_replay_alone, trail.files, chunksize=max(1, len(trail.files) // (jobs * 8))))
    else:
        parts = [_replay_alone(path, observe) for path in trail.files]
    problems: list[Problem] = []
    replays: dict[tuple[int, int], _Replay] = {}
    files = []
    for path, (summary, own, own_problems, notes) in zip(trail.files, parts, strict=True):
        files.append(summary)
        problems.extend(own_problems)
        trail.notes.extend(notes)
        for key, replay in own.items():
            if key in replays:
                raise TrailError(
                    f"{path}: rank {key[1]}, attempt {key[0]} is also in {replays[key].origin}; pass one trail per rank"
                )
            replays[key] = replay
    attempts = _attempts(replays)
    for attempt in attempts:
        _check_attempt(attempt, problems, trail.notes)
    problems.sort(key=_problem_order)
    return AuditReport(files, attempts, problems, trail.notes, _run_problems(attempts))


def _jobs(jobs: int | None, trail: Trail) -> int:
    if jobs is not None:
        if jobs < 1:
            raise ValueError(f"jobs must be a positive number of processes; got {jobs}")
        return min(jobs, len(trail.files))
    if len(trail.files) < 2 or sum(p.stat().st_size for f in trail.files for p in _parts_of(f)) < PARALLEL_BYTES:
        return 1
    return min(len(trail.files), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def _parts_of(path: Path) -> list[Path]:
    return [p for p in (*segments.closed_segments(path), path) if p.exists()]


def _replay_alone(
    path: Path, observe: Callable[[Record], None] | None = None
) -> tuple[dict[str, Any], dict[tuple[int, int], _Replay], list[Problem], list[Note]]:
    """One file's replays, problems and notes, on their own (in a worker process, or here)."""
    problems: list[Problem] = []
    notes: list[Note] = []
    replays: dict[tuple[int, int], _Replay] = {}
    summary = _replay_file(path, notes, replays, problems, observe)
    for replay in replays.values():
        replay.problems = []  # they are in ``problems``: not sent back twice
    return summary, replays, problems, notes


def _replay_file(
    path: Path,
    notes: list[Note],
    replays: dict[tuple[int, int], _Replay],
    problems: list[Problem],
    observe: Callable[[Record], None] | None,
) -> dict[str, Any]:
    """Feed one file's records to the replays of their (attempt, rank); returns the file's summary.

    A file normally holds one rank's attempts one after the other, so the current replay is kept
    at hand and looked up again only when the attempt (or rank) changes.
    """
    ranks: list[int] = []
    events = 0
    attempt = rank = -1
    current: _Replay | None = None
    latest: dict[int, int] = {}  # rank -> the highest attempt seen in this file
    taken = 0  # steps records the current replay took without a Record

    def routine(data: dict[str, Any], file: str, line: int) -> bool:
        """A steps record of the attempt being replayed: straight to it (most lines)."""
        nonlocal taken
        if current is None or data["attempt"] != attempt or data["rank"] != rank:
            return False
        current.steps(data, file, line)
        taken += 1
        return True

    for record in read_records(path, notes, None if observe is not None else routine):
        events += 1
        if observe is not None:
            observe(record)
        if record.attempt != attempt or record.rank != rank:
            attempt, rank = record.attempt, record.rank
            current = _replay_for(record, replays, problems, latest, str(path))
            if rank not in ranks:
                ranks.append(rank)
        current.feed(record)  # type: ignore[union-attr]
    return {"path": str(path), "ranks": ranks, "events": events + taken}


def _replay_for(
    record: Record,
    replays: dict[tuple[int, int], _Replay],
    problems: list[Problem],
    latest: dict[int, int],
    origin: str,
) -> _Replay:
    """The replay of the record's (attempt, rank); checks that attempts follow each other in a file
    (a restarted process appends to its rank's file) and that no other file holds the same."""
    previous = latest.get(record.rank)
    if previous is not None and record.attempt < previous:
        problems.append(
            Problem(
                "malformed",
                f"attempt {record.attempt} after attempt {previous} in the same file",
                record.file,
                record.line,
                record.rank,
                record.attempt,
            )
        )
    latest[record.rank] = max(record.attempt, previous if previous is not None else record.attempt)
    key = (record.attempt, record.rank)
    replay = replays.get(key)
    if replay is None:
        replay = replays[key] = _Replay(record, problems, origin)
    elif replay.origin != origin:
        raise TrailError(
            f"{record.where()}: rank {record.rank}, attempt {record.attempt} is also in {replay.origin}; "
            f"pass one trail per rank"
        )
    return replay


def _attempts(replays: dict[tuple[int, int], _Replay]) -> list[AttemptReport]:
    by_attempt: dict[int, list[RankAttempt]] = {}
    for (attempt, _), replay in sorted(replays.items()):
        by_attempt.setdefault(attempt, []).append(replay.result)
    return [AttemptReport(attempt, ranks) for attempt, ranks in sorted(by_attempt.items())]


def _check_attempt(attempt: AttemptReport, problems: list[Problem], notes: list[Note]) -> None:
    headless = [r.rank for r in attempt.ranks if r.run_id is None]
    if headless:
        notes.append(
            Note(f"{_who(headless)}, attempt {attempt.attempt} has no run_start (the trail begins mid-attempt?)")
        )
    world = attempt.first.world_size
    present = [r.rank for r in attempt.ranks]
    if world is not None and len(present) < world:
        notes.append(Note(f"attempt {attempt.attempt}: world_size is {world}, but the trail has {_who(present)}"))
    if len(attempt.ranks) > 1:
        if attempt.killed:
            notes.append(Note(f"attempt {attempt.attempt}: ranks not compared, as not every rank has an exit event"))
        else:
            _compare_ranks(attempt, problems)


def _run_problems(attempts: list[AttemptReport]) -> list[Problem]:
    """How the run did not end well. Only the last attempt counts: after a killed, failed,
    interrupted or unrequeued attempt, a later one means the run was resumed or restarted."""
    if not attempts:
        return []
    last = attempts[-1]
    found = []
    for (state, step), killed in _group(last.killed_at(), lambda k: (k["state"], k["step"])).items():
        k = killed[0]
        since = _since(k["since_previous"]) if len(killed) == 1 else ""
        found.append(
            Problem(
                "killed",
                f"attempt {last.attempt}: {_who([x['rank'] for x in killed])} killed: no exit event, "
                f"{'its trail ends' if len(killed) == 1 else 'their trails end'} in {state} at step {step}{since}; "
                f"no later attempt resumed {'it' if len(killed) == 1 else 'them'}",
                k["file"],
                k["line"],
                k["rank"],
                last.attempt,
            )
        )
    for reason in ("failed", "interrupted"):
        ranks = [r for r in last.ranks if (r.exit or {}).get("reason") == reason]
        if not ranks:
            continue
        r = ranks[0]
        code = (r.exit or {}).get("code")
        cause = f": {r.exceptions[0]['type']}: {_first_line(r.exceptions[0]['message'])[:80]}" if r.exceptions else ""
        who = _who([x.rank for x in ranks])
        found.append(
            Problem(
                reason,
                f"attempt {last.attempt} {reason} on {who} at step {r.end_step} (exit code {code}){cause}; "
                f"no later attempt",
                r.file,
                r.exit_line,
                r.rank,
                last.attempt,
            )
        )
    requeue = last.first.requeue
    if requeue is not None and not requeue["ok"]:
        found.append(
            Problem(
                "requeue_refused",
                f"attempt {last.attempt}: the job was not requeued ({requeue['command'] or 'no command'}: "
                f"{_first_line(requeue['message'])}); no later attempt: nothing will resume the run",
                last.first.file,
                last.first.requeue_line,
                last.first.rank,
                last.attempt,
            )
        )
    return found


def _since(seconds: float | None) -> str:
    return "" if seconds is None else f", {seconds:.2f} s after the record before it"


#: What every rank of an attempt must agree on: (label, value of a rank).
_AGREEMENT: Final = (
    ("steps done", lambda r: (r.first_step, r.last_step, r.steps_done)),
    ("retry steps", lambda r: [x["step"] for x in r.retries]),
    # Each rank skips a micro-batch whose loss is None on any rank (loss_none_agreement=True) or
    # returns None on every rank at once; a rank that skips alone breaks DDP's gradient all-reduce.
    ("loss=None micro-batches", lambda r: r.loss_none_at),
    ("checkpoint steps", lambda r: r.checkpoint_steps),
    ("restored step", lambda r: r.resumed_from_step),
    ("agreed signal step", lambda r: r.agreed["step"] if r.agreed else None),
    ("exit reason", lambda r: (r.exit or {}).get("reason")),
    ("exit code", lambda r: (r.exit or {}).get("code")),
)


def _compare_ranks(attempt: AttemptReport, problems: list[Problem]) -> None:
    """One problem per label and differing value, naming every rank that has it: a thousand ranks
    where one differs give one line, not a thousand."""
    reference = attempt.first
    for label, value in _AGREEMENT:
        expected = value(reference)
        differing = [other for other in attempt.ranks[1:] if value(other) != expected]
        for others in _group(differing, lambda r, value=value: repr(value(r))).values():  # type: ignore[misc]
            other = others[0]
            problems.append(
                Problem(
                    "rank_disagreement",
                    f"attempt {attempt.attempt}: {label}: rank {reference.rank} {_show(expected)}, "
                    f"{_who([r.rank for r in others])} {_show(value(other))}",
                    other.file,
                    other.exit_line,
                    other.rank,
                    attempt.attempt,
                )
            )


def _group(items: Iterable[Any], key: Callable[[Any], Any]) -> dict[Any, list[Any]]:
    """Items by ``key``, groups in order of first appearance."""
    groups: dict[Any, list[Any]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def _who(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-511, 513-1023``: runs of consecutive ranks as ranges."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"


def _ranges(ranks: Iterable[int]) -> str:
    parts: list[str] = []
    ordered = sorted(ranks)
    start = previous = ordered[0] if ordered else 0
    for rank in ordered[1:]:
        if rank != previous + 1:
            parts.append(f"{start}-{previous}" if previous > start else str(start))
            start = rank
        previous = rank
    if ordered:
        parts.append(f"{start}-{previous}" if previous > start else str(start))
    return ", ".join(parts)


def _how_ended(r: RankAttempt) -> str:
    if r.exit is None:
        return f"killed (no exit event; the trail ends in {r.end_state} at step {r.end_step})"
    text = f"{r.exit['reason']} (code {r.exit['code']}"
    if r.exit["reason"] == "failed" and r.exceptions:
        text += f", {r.exceptions[0]['type']}: {_first_line(r.exceptions[0]['message'])[:80]}"
    return text + ")"


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 3:  # steps done
        first, last, done = value
        return f"{done} (steps {first}-{last})" if done else "0"
    return "none" if value is None or value == [] else str(value)


def _problem_order(problem: Problem) -> tuple[Any, ...]:
    return (problem.attempt if problem.attempt is not None else -1, problem.file or "", problem.line or 0)


# -------------------------------------------------------------------- text rendering
def render(report: AuditReport) -> str:
    """The report for people: one block per attempt, then notes, problems and run problems, then the
    verdict on the trail and on the run."""
    ranks = sorted({rank for info in report.files for rank in info["ranks"]})
    events = sum(info["events"] for info in report.files)
    lines = [
        f"{_plural(len(report.files), 'file')} ({_plural(len(ranks), 'rank')}), "
        f"{_plural(len(report.attempts), 'attempt')}, {_plural(events, 'event')}"
    ]
    previous = None
    for attempt in report.attempts:
        lines.append("")
        lines.extend(_render_attempt(attempt, previous))
        previous = attempt
    if report.notes:
        lines.append("")
        lines.append("notes:")
        lines.extend(_at_most(f"  {_prefix(n.where())}{n.message}" for n in report.notes))
    for title, found in (("problems", report.problems), ("run problems", report.run_problems)):
        if found:
            lines.append("")
            lines.append(f"{title}:")
            lines.extend(_at_most(f"  {_prefix(p.where())}[{p.kind}] {p.message}" for p in found))
    lines.append("")
    lines.extend(verdict(report))
    return "\n".join(lines)


#: Lines a section of the text report shows; the rest are counted (``--json`` has them all).
SECTION_LINES: Final = 20


def _at_most(lines: Iterable[str], limit: int = SECTION_LINES) -> list[str]:
    shown = list(lines)
    if len(shown) <= limit:
        return shown
    return [*shown[: limit - 1], f"  ... and {len(shown) - limit + 1} more (--json lists them all)"]


def verdict(report: AuditReport) -> list[str]:
    """Two lines: is the trail consistent with the machine; did the run end well."""
    if report.consistent:
        trail = "consistent: every transition is a row of the machine, steps follow on, the ranks agree"
    else:
        trail = f"INCONSISTENT: {_plural(len(report.problems), 'problem')}"
    if report.run_problems:
        run = "run problems: " + ", ".join(dict.fromkeys(p.kind for p in report.run_problems))
    elif report.attempts and report.attempts[-1].first.exit is not None:
        last = report.attempts[-1]
        exit = last.first.exit or {}
        run = f"run ended well: attempt {last.attempt} {exit['reason']} (exit code {exit['code']})"
    else:
        run = "run ended well"
    return [trail, run]


def _render_attempt(attempt: AttemptReport, previous: AttemptReport | None = None) -> list[str]:
    data = attempt.as_dict()
    first = attempt.first
    how = {"launch": "launch", "resume": f"resume from step {first.resumed_from_step}", None: "start unknown"}
    seconds = data["ended_at"] - data["started_at"]
    ranks = data["ranks"]
    rank_text = _who(ranks)
    lines = [f"attempt {attempt.attempt}: {how[first.start]}, {rank_text}, {seconds:.2f} s"]
    if previous is not None and first.torchelastic and first.torchelastic.get("restart_count"):
        elastic = first.torchelastic
        limit = f" of at most {elastic['max_restarts']}" if elastic.get("max_restarts") is not None else ""
        lines.append(
            f"  torchrun restart {elastic['restart_count']}{limit}, after attempt {previous.attempt} ended: "
            f"{previous.ended()}"
        )
    steps = f"steps {first.first_step}-{first.last_step}" if first.steps_done else "no steps"
    retries = ", ".join(f"step {x['step']} (#{x['retry']})" for x in first.retries) or "none"
    lines.append(
        f"  {steps}: {first.steps_done} done, {first.micro_batches} micro-batches"
        + (f" ({first.loss_none} with loss=None)" if first.loss_none else "")
        + f", retries: {retries}"
        + (f", fp16 skipped steps: {_steps(first.scaler_skips)}" if first.scaler_skips else "")
    )
    lines.append("  checkpoints: " + _render_checkpoints(data["checkpoints"]))
    lines.append("  signals: " + _render_signals(data["signals"]))
    for (kind, message), alike in _group(data["exceptions"], lambda e: (e["type"], _first_line(e["message"]))).items():
        lines.append(f"  exception on {_who([e['rank'] for e in alike])}: {kind}: {message}")
    if first.requeue is not None:
        lines.append(f"  requeue: {'done' if first.requeue['ok'] else 'FAILED'}: {first.requeue['message']}")
    if len(attempt.ranks) > 1 and len({(r.exit or {}).get("reason") for r in attempt.ranks}) > 1:
        lines.append(f"  ended: {attempt.ended()}")  # the ranks ended differently
    elif first.exit is not None:
        lines.append(f"  exit: {first.exit['reason']}, code {first.exit['code']}")
    else:
        for (state, step), killed in _group(attempt.killed_at(), lambda k: (k["state"], k["step"])).items():
            k = killed[0]
            if len(killed) == 1:
                where, since = f"its last record ({k['file']}:{k['line']})", _since(k["since_previous"])
            else:
                where, since = "their last records", ""
            lines.append(
                f"  exit: none: {_who([x['rank'] for x in killed])} killed at {where}: {state} at step {step}{since}"
            )
    return lines


def _render_checkpoints(checkpoints: dict[str, list[dict[str, Any]]]) -> str:
    parts = []
    if checkpoints["loaded"]:
        parts.append("loaded " + ", ".join(f"step {c['step']} ({c['path']})" for c in checkpoints["loaded"]))
    parts.append("saved " + (_steps([c["step"] for c in checkpoints["saved"]]) or "none"))
    if checkpoints["skipped"]:
        parts.append("skipped " + "; ".join(f"{c['path']}: {c['reason']}" for c in checkpoints["skipped"]))
    if checkpoints["failed"]:
        parts.append("failed " + "; ".join(f"{c['type']}: {c['message']}" for c in checkpoints["failed"]))
    return ", ".join(parts)


def _render_signals(signals: dict[str, Any]) -> str:
    received = [
        f"{signal} on {_who([s['rank'] for s in alike])} at step {step} ({state})"
        for (signal, step, state), alike in _group(
            signals["received"], lambda s: (s["signal"], s["at_step"], s["at_state"])
        ).items()
    ]
    text = ", ".join(received) or "none"
    agreed = signals["agreed"]
    if agreed is not None:
        text += f"; agreed {agreed['signal']} at step {agreed['step']}"
    return text


def _steps(steps: list[Any]) -> str:
    if len(steps) > 12:
        return f"{', '.join(map(str, steps[:5]))}, ... {', '.join(map(str, steps[-5:]))} ({len(steps)} in all)"
    return ", ".join(map(str, steps))


def _first_line(text: Any) -> str:
    lines = str(text).splitlines()
    return lines[0] if lines else ""


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
