"""The audit's report, ``AuditReport``: its JSON (``as_dict``) and its text for people (``render``,
``verdict``), where ranks that did alike are one group.

``trainfsm audit --json`` prints one object (schema ``trainfsm.audit/1``; fields are only ever
added)::

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
          "saved":   [{"step": int, "path": str, "kept": bool, "asynchronous": bool, "bytes": int,
                       "checksum": str, "data": {"epoch": int, "batches": int} | {"ranks": [[int, int]]} | null,
                       "ts": float}],
          "loaded":  [{"step": int, "path": str}],
          "skipped": [{"path": str, "reason": str}],
          "failed":  [{"type": str, "message": str}]},
        "signals": {
          "received": [{"rank": int, "signal": str, "at_step": int|null, "at_state": str|null, "ts": float}],
          "agreed": {"signal": str, "step": int, "reason": "signal" | "deadline" | "preemption"} | null},
        "preemption": {                       # null: not preempted (trainfsm.tools.preemption_timing)
          "cause": "signal" | "deadline" | "preemption",   # a signal, the trainer's own deadline (the
                                              # job's end), or SLURM's PreemptTime seen by rank 0
          "signal": str | null, "at": float | null,   # epoch seconds of the signal (deadline: its
                                              # decision; preemption: PreemptTime)
          "at_step": int | null, "agreed_step": int | null,
          "preempted": {"preempt_time", "grace_end", "grace_time", "mode", "read_at",
                        "noticed_at"} | null,   # the preempted event's fields
          "noticed": float | null,            # preemption: seconds after "at" the trainer took it
          "step_finished": float | null, "agreed": float | null,   # seconds after "at"
          "durable": float | null, "exit": float | null,
          "job_end": float | null,            # the deadline, epoch seconds: job_end.kill_at (SIGKILL)
          "job_end_read": "signal" | "start" | null,   # read after the signal, or at run_start
          "applied": "grace_time" | "kill_wait" | "time_limit" | null,   # which deadline applied
          "kill_wait": float | null,          # the cluster's KillWait, seconds
          "warning": float | null,            # job_end - at
          "margin": float | null,             # job_end - the exit event
          "save_after_end": bool,
          "deadline": {"step": int, "end_time", "decided_at", "left", "needed", "steps", "step_seconds",
                       "save_seconds", "save_measured", "write_seconds", "exit_seconds",
                       "margin"} | null},   # its event's fields
        "exceptions": [{"rank": int, "type": str, "message": str, "file": str, "line": int}],
        "stalls": [{"rank": int, "state": str, "step": int,   # the stall watchdog's reports, one per stall:
                    "seconds": float, "reports": int,          # the longest reported, and how many
                    "doing": str|null, "collective": str|null, "hook": str|null,
                    "at": str|null,                            # the innermost frame, file:line function
                    "cleared": float|null,                     # seconds until it moved again; null: never
                    "ended": "collective_failed"|null}],        # how a stall not cleared ended, if it did
        "requeue": {"ok": bool, "command": str|null, "message": str,
                    "requeued_by": "trainer" | "slurm" | null} | null,
        "exit": {"reason": str, "code": int} | null,   # null: no exit event on the first rank
        "ended": str,                         # how each rank ended: "rank 0 killed (...), rank 1 failed (...)"
        "torchelastic": {"restart_count": int, "max_restarts": int|null, "run_id": str|null,
                         "group": int|null} | null,
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
     "run_problems": [...],                   # as "problems", kinds of audit.RUN_PROBLEM_KINDS
     "notes": [{"message": str, "file": str|null, "line": int|null}],
     "ledger": [str],                         # the data ledger (trainfsm.tools.ledger), a line per rank group
     "ledger_checked": str}                   # what the ledger proved and how, what it assumed

Attempt-level values are those of the attempt's lowest rank, except ``checkpoints.saved``,
``skipped`` and ``failed`` (rank 0 writes checkpoints), ``signals.received`` and ``exceptions``,
which gather all ranks.

The text helpers (``ranks_text``, ``group_by``, ``since_text``, ``first_line``) also word the
audit's own problems, so that a problem and the report name ranks the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from trainfsm.machine import ExitReason
from trainfsm.tools import preemption_timing, report_fields
from trainfsm.tools.replay import Problem, RankAttempt
from trainfsm.tools.words import (
    first_line,
    group_by,
    position,
    ranks_text,
    requeue_text,
    since_text,
    stall_end_text,
)
from trainfsm.trail.reader import Note

SCHEMA: Final = "trainfsm.audit/1"


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
        groups = group_by(self.ranks, _how_ended).items()
        return "; ".join(f"{ranks_text([r.rank for r in ranks])} {how}" for how, ranks in groups)

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
            "preemption": preemption_timing.entry(self.ranks),
            "exceptions": [e for r in self.ranks for e in r.exceptions],
            "stalls": [report_fields.stall_dict(s) for r in self.ranks for s in r.stalls],
            "requeue": first.requeue,
            "exit": first.exit,
            "ended": self.ended(),
            "torchelastic": first.torchelastic,
            "killed": self.killed,
            "killed_at": self.killed_at(),
            "end": {"state": first.end_state, "step": first.end_step},
            "started_at": min(r.started_at for r in self.ranks),
            "ended_at": max(r.ended_at for r in self.ranks),
            "per_rank": [report_fields.rank_dict(r) for r in self.ranks],
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
    ledger: list[str] = field(default_factory=list)  # the data ledger, a line per group of ranks
    ledger_checked: str = ""  # what the ledger proved and how, what it assumed

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
            "ledger": self.ledger,
            "ledger_checked": self.ledger_checked,
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


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
    if report.ledger:
        lines.append("")
        lines.extend(_ledger_text(report.ledger))
        if report.ledger_checked:
            lines.append(f"  checked: {report.ledger_checked}")
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


def _ledger_text(ledger: list[str]) -> list[str]:
    """The data ledger for people: its one line inline; else the groups of ranks it could not
    certify, then those it did (summed up past a few: ``--json`` lists each)."""
    from trainfsm.tools.ledger import proven  # the ledger words its lines with this module's helpers

    if len(ledger) == 1:
        return [f"data ledger: {ledger[0]}"]
    fine = [line for line in ledger if proven(line)]
    broken = [line for line in ledger if not proven(line)]
    lines = ["data ledger:", *_at_most((f"  {line}" for line in broken), limit=10)]
    if len(fine) <= 3:
        lines.extend(f"  {line}" for line in fine)
    else:
        lines.append(f"  each micro-batch kept once on the other {len(fine)} groups of ranks (--json lists each)")
    return lines


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


def group_restart(elastic: dict[str, Any] | None) -> int | None:
    """Which restart of torchrun's group an attempt is (0: the launch), as every node agrees: from
    the group number ``init_distributed`` joined; without it, the reporting agent's own count (an
    agent whose workers did not fail counts no restart)."""
    if not elastic:
        return None
    group = elastic.get("group")
    return group - 1 if isinstance(group, int) else elastic.get("restart_count")


def _ooms(ooms: list[dict[str, Any]]) -> str:
    """``step 1 (forward): 2 pieces, step 1 (forward): 4 pieces``: each split, where it came from."""
    return ", ".join(f"step {o['step']} ({o['phase']}): {o['pieces']} pieces" for o in ooms)


def _render_attempt(attempt: AttemptReport, previous: AttemptReport | None = None) -> list[str]:
    data = attempt.as_dict()
    first = attempt.first
    how = {"launch": "launch", "resume": f"resume from step {first.resumed_from_step}", None: "start unknown"}
    seconds = data["ended_at"] - data["started_at"]
    ranks = data["ranks"]
    rank_text = ranks_text(ranks)
    lines = [f"attempt {attempt.attempt}: {how[first.start]}, {rank_text}, {seconds:.2f} s"]
    elastic = first.torchelastic or {}
    restart = group_restart(elastic)
    if previous is not None and restart:
        maximum = elastic.get("max_restarts")
        limit = f" of at most {maximum}" if maximum is not None else ""
        lines.append(f"  torchrun restart {restart}{limit}, after attempt {previous.attempt} ended: {previous.ended()}")
    steps = f"steps {first.first_step}-{first.last_step}" if first.steps_done else "no steps"
    retries = ", ".join(f"step {x['step']} (#{x['retry']})" for x in first.retries) or "none"
    lines.append(
        f"  {steps}: {first.steps_done} done, {first.micro_batches} micro-batches"
        + (f" ({first.loss_none} with loss=None)" if first.loss_none else "")
        + f", retries: {retries}"
        + (f", fp16 skipped steps: {_steps(first.scaler_skips)}" if first.scaler_skips else "")
        + (f", out of memory: {_ooms(first.ooms)}" if first.ooms else "")
    )
    lines.append("  checkpoints: " + _render_checkpoints(data["checkpoints"]))
    lines.append("  signals: " + _render_signals(data["signals"]))
    if data["preemption"] is not None:
        lines.append(preemption_timing.text(data["preemption"]))
    for (kind, message), alike in group_by(data["exceptions"], lambda e: (e["type"], first_line(e["message"]))).items():
        lines.append(f"  exception on {ranks_text([e['rank'] for e in alike])}: {kind}: {message}")
    for stall in data["stalls"][:SECTION_LINES]:
        doing = f": {stall['doing']}" if stall["doing"] else ""
        reports = "its one report" if stall["reports"] == 1 else f"the last of {stall['reports']} reports"
        lines.append(
            f"  stall on rank {stall['rank']}: {position(stall['state'], stall['step'])}, "
            f"{stall['seconds']:.1f} s at {reports}, {stall_end_text(stall)}{doing}"
        )
    if first.requeue is not None:
        lines.append(f"  requeue: {requeue_text(first.requeue)}: {first.requeue['message']}")
    if len(attempt.ranks) > 1 and len({(r.exit or {}).get("reason") for r in attempt.ranks}) > 1:
        lines.append(f"  ended: {attempt.ended()}")  # the ranks ended differently
    elif first.exit is not None:
        lines.append(f"  exit: {first.exit['reason']}, code {first.exit['code']}")
    else:
        for (state, step), killed in group_by(attempt.killed_at(), lambda k: (k["state"], k["step"])).items():
            k = killed[0]
            if len(killed) == 1:
                where, since = f"its last record ({k['file']}:{k['line']})", since_text(k["since_previous"])
            else:
                where, since = "their last records", ""
            lines.append(
                f"  exit: none: {ranks_text([x['rank'] for x in killed])} killed at {where}: "
                f"{position(state, step)}{since}"
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
        f"{signal} on {ranks_text([s['rank'] for s in alike])} at step {step} ({state})"
        for (signal, step, state), alike in group_by(
            signals["received"], lambda s: (s["signal"], s["at_step"], s["at_state"])
        ).items()
    ]
    text = ", ".join(received) or "none"
    agreed = signals["agreed"]
    if agreed is not None and agreed.get("reason") == "deadline":  # no signal came: the trainer's own
        text += f"; the job's end near: agreed at step {agreed['step']} to leave as if by {agreed['signal']}"
    elif agreed is not None and agreed.get("reason") == "preemption":  # rank 0 saw SLURM's PreemptTime
        text += f"; SLURM preempted the job: agreed at step {agreed['step']} to leave as if by {agreed['signal']}"
    elif agreed is not None:
        text += f"; agreed {agreed['signal']} at step {agreed['step']}"
    return text


def _steps(steps: list[Any]) -> str:
    if len(steps) > 12:
        return f"{', '.join(map(str, steps[:5]))}, ... {', '.join(map(str, steps[-5:]))} ({len(steps)} in all)"
    return ", ".join(map(str, steps))


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _how_ended(r: RankAttempt) -> str:
    if r.exit is None:
        return f"killed (no exit event; the trail ends in {position(r.end_state, r.end_step)})"
    text = f"{r.exit['reason']} (code {r.exit['code']}"
    if r.exit["reason"] == ExitReason.FAILED and r.exceptions:
        text += f", {r.exceptions[0]['type']}: {first_line(r.exceptions[0]['message'])[:80]}"
    return text + ")"
