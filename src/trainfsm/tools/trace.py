"""``trainfsm trace``: the story of each attempt that did not complete.

For every failed, interrupted, preempted or killed attempt (no ``exit`` event: reported at its
last record): with several ranks, the cause (the earliest exception on a rank that did not fail in
a collective because of another); on each rank, the last N events before the end, the state and
step where the trail ends, every exception with its traceback; then what the next attempt did
(resumed from which checkpoint, skipped which, or started afresh). It ends with the audit's
verdict (``trainfsm.tools.report.verdict``): is the trail consistent, did the run end well.

Where a trail ends is said with one number, the trainer's step as the replay has it (as
``trainfsm audit`` says it): in STEP, ACCUMULATE and RETRY the step being run (``running step
1285``), elsewhere the step the state belongs to (``CHECKPOINT at step 1284``). It is not the
last record's own ``step`` field: the trainer counts a step on entering STEP, after the transition
into STEP is written (with the step just done), and a compact ``steps`` record carries the last
step it holds, so after either the trainer is in STEP one step further than the record says.

The trail is read once: the audit's replay gives the attempts' outcome, and a bounded tail per rank
and attempt keeps the last events, so a week-long trail costs no more memory than a short one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from trainfsm.machine import ExitReason
from trainfsm.tools import preemption_timing
from trainfsm.tools.audit import audit_trail
from trainfsm.tools.replay import RankAttempt
from trainfsm.tools.report import AttemptReport, AuditReport, group_restart, verdict
from trainfsm.tools.words import position, ranks_text, requeue_text, since_text, stall_end_text
from trainfsm.trail.reader import Record, open_trail

DEFAULT_EVENTS: Final = 10

#: Exit reasons that get a story (as does an attempt without an exit event).
_TRACED: Final = frozenset({ExitReason.FAILED, ExitReason.INTERRUPTED, ExitReason.PREEMPTED, ExitReason.STALLED})

#: Fields every event has; the rest are what an event says.
_COMMON: Final = frozenset({"ts", "event", "rank", "step", "state", "run_id", "attempt", "traceback"})


@dataclass(slots=True)
class _Tail:
    """The last events of one rank's attempt, and its exceptions in full."""

    events: deque[Record]
    exceptions: list[Record] = field(default_factory=list)
    collective_failed: bool = False  # this rank failed in a collective because of another rank
    repeated: Record | None = None  # a stall exit where the attempt before stalled too (its ``repeats``)


@dataclass(slots=True)
class TraceReport:
    audit: AuditReport
    tails: dict[tuple[int, int], _Tail]

    def traced(self) -> list[AttemptReport]:
        """The attempts worth a story: failed, interrupted, preempted, stalled, killed, or with a rank
        whose trail ends in a stall (a run that hangs as the trail is read)."""
        return [
            a
            for a in self.audit.attempts
            if a.killed or _reason(a) in _TRACED or any(r.stall_open or _stalled(r) for r in a.ranks)
        ]


def trace(inputs: Iterable[Path], events: int = DEFAULT_EVENTS) -> TraceReport:
    """Read the trail of ``inputs`` once; ``TrailError`` when it is unreadable."""
    tails: dict[tuple[int, int], _Tail] = {}

    def observe(record: Record) -> None:
        key = (record.attempt, record.rank)
        tail = tails.get(key)
        if tail is None:
            tail = tails[key] = _Tail(deque(maxlen=events))
        tail.events.append(record)
        if record.name == "exception":
            tail.exceptions.append(record)
        elif record.name == "collective_failed":
            tail.collective_failed = True
        elif record.name == "exit" and record.data.get("repeats") is not None:
            tail.repeated = record

    report = audit_trail(open_trail(inputs), observe=observe)
    return TraceReport(report, tails)


def render(report: TraceReport) -> str:
    traced = report.traced()
    attempts = report.audit.attempts
    if not traced:
        outcomes = ", ".join(sorted({_reason(a) or "?" for a in attempts}))
        lines = [
            f"Nothing to trace: no attempt failed, was interrupted, preempted or killed ({len(attempts)} attempts: "
            f"{outcomes})."
        ]
    else:
        lines = []
        for attempt in traced:
            if lines:
                lines.append("")
            lines.extend(_render_attempt(report, attempt))
    return "\n".join([*lines, "", *verdict(report.audit)])


def _reason(attempt: AttemptReport) -> str | None:
    exit = attempt.first.exit
    return None if exit is None else str(exit["reason"])


def _render_attempt(report: TraceReport, attempt: AttemptReport) -> list[str]:
    first = attempt.first
    if first.exit is None:
        where = "; ".join(
            f"rank {k['rank']} at {k['file']}:{k['line']}, {position(k['state'], k['step'])}"
            + since_text(k["since_previous"])
            for k in attempt.killed_at()
        )
        if any(r.stall_open for r in attempt.ranks):  # a hang: alive and stuck, or killed while stuck
            outcome = (
                f"no exit event: it hung (stall reports below), then was killed or was still hanging when the "
                f"trail was read; last records: {where}"
            )
        else:
            outcome = f"killed at its last record ({where}); no exit event, so its last transitions may be missing"
    else:
        outcome = f"{first.exit['reason']} (exit code {first.exit['code']})"
        failed = [r.rank for r in attempt.ranks if r.stall_open is not None and r.stall_open.get("ended")]
        if failed:  # the timeout is the stall's consequence: the story below names the cause
            outcome += (
                f" after a stall: the collective {ranks_text(failed)} waited in failed at the process group's timeout"
            )
    lines = [f"attempt {attempt.attempt}: {outcome}"]
    timing = preemption_timing.entry(attempt.ranks)
    if timing is not None:
        lines.append(preemption_timing.text(timing))
    if first.requeue is not None:
        lines.append(f"  requeue: {requeue_text(first.requeue)}: {first.requeue['message']}")
    story = _stall_story(attempt)
    lines.extend(story)
    for rank in attempt.ranks:
        repeated = report.tails[(attempt.attempt, rank.rank)].repeated
        if repeated is not None:
            lines.append(
                f"  repeated: rank {rank.rank} stalled in {position(repeated.state, repeated.step)} as attempt "
                f"{repeated.data['repeats']} did: not requeued (the next attempt would resume from the same "
                "checkpoint and stall there again)"
            )
    cause = None if story else _cause(report, attempt)  # a stall's story names the cause itself
    if cause is not None:
        lines.append(cause)
    for rank in attempt.ranks:
        tail = report.tails[(attempt.attempt, rank.rank)]
        last = tail.events[-1]
        where = position(rank.end_state, rank.end_step)  # the replay's, not the last record's step field
        lines.append(f"  rank {rank.rank}: the trail ends in {where} ({last.where()})")
        lines.append(f"    last {len(tail.events)} events:")
        lines.extend(f"      {_describe(record, last.ts)}" for record in tail.events)
        for exc in tail.exceptions:
            data = exc.data
            lines.append(f"    exception ({exc.where()}): {data.get('type')}: {data.get('message')}")
            lines.extend(f"      {text}" for text in str(data.get("traceback") or "").rstrip().splitlines())
    lines.append("  " + _next_attempt(report.audit, attempt.attempt, first.requeue))
    return lines


def _cause(report: TraceReport, attempt: AttemptReport) -> str | None:
    """With several ranks: the exception that started it. A rank whose collective failed because
    of another (``collective_failed``) is a consequence; the earliest other exception is the cause."""
    if len(attempt.ranks) < 2:
        return None
    tails = [report.tails[(attempt.attempt, rank.rank)] for rank in attempt.ranks]
    own = [exc for tail in tails if not tail.collective_failed for exc in tail.exceptions[:1]]
    followers = sorted(rank.rank for rank, tail in zip(attempt.ranks, tails, strict=True) if tail.collective_failed)
    after = f"; rank(s) {', '.join(map(str, followers))} then failed in a collective" if followers else ""
    if not own:  # nobody raised first: a rank that vanished (SIGKILL, OOM killer, a lost node) is the cause
        killed = [k for k in attempt.killed_at() if k["rank"] not in followers]
        if not killed:
            return None
        where = "; ".join(f"rank {k['rank']} in {position(k['state'], k['step'])}" for k in killed)
        return f"  cause: killed: {where} (its trail just ends, no exit event){after}"
    first = min(own, key=lambda record: record.ts)
    data = first.data
    return (
        f"  cause: rank {first.rank} in {position(first.state, first.step)}: {data.get('type')}: "
        f"{_short(data.get('message'))} ({first.where()}){after}"
    )


def _stalled(rank: RankAttempt) -> bool:
    return (rank.exit or {}).get("reason") == ExitReason.STALLED


def _stall_story(attempt: AttemptReport) -> list[str]:
    """Who holds the others up, and where each rank is. A rank the watchdog reports stuck keeps
    writing ``stall`` events (2x, 4x, ... its budget) until it moves, ends, or is killed; a rank
    frozen (SIGSTOP, a hung node) or killed writes nothing more, so among ranks that wait in a
    collective, the one whose trail went quiet is the one to look at."""
    stalls = {
        r.rank: (r.stall_open or r.stalls[-1]) for r in attempt.ranks if r.stall_open or (_stalled(r) and r.stalls)
    }
    if not stalls:
        return []
    waiting = {rank for rank, stall in stalls.items() if stall.get("collective")}
    latest = max(stall["last_ts"] for stall in stalls.values())
    lines = []
    holding: list[str] = []
    for r in attempt.ranks:
        stall = stalls.get(r.rank)
        if stall is not None and r.rank not in waiting:
            how = "stuck, then ended by the stall watchdog" if _stalled(r) else "stuck, alive at its last report"
            holding.append(f"rank {r.rank}: {how}: {_stall_text(stall)}")
        elif stall is None and r.exit is None:
            quiet = latest - r.ended_at
            holding.append(
                f"rank {r.rank}: no record for {quiet:.1f} s before the others' last stall report, last in "
                f"{position(r.end_state, r.end_step)} ({r.file}:{r.end_line}): frozen or killed (a rank that is "
                f"alive but stuck keeps writing stall events)"
            )
        elif stall is None and r.exit is not None and r.exit.get("reason") != ExitReason.STALLED:
            holding.append(f"rank {r.rank}: left the group: exit {r.exit['reason']} (code {r.exit['code']})")
    if holding and waiting:
        lines.append("  held up by: " + "; ".join(holding))
    elif holding:
        lines.append("  stalled: " + "; ".join(holding))
    for rank in sorted(waiting):
        lines.append(f"  waiting: rank {rank}: {_stall_text(stalls[rank])}")
    return lines


def _stall_text(stall: dict[str, Any]) -> str:
    since = datetime.fromtimestamp(stall["first_ts"] - (stall["seconds"] or 0), timezone.utc)
    if stall.get("reports") and stall["reports"] > 1:  # the first report's own seconds went up to the last's
        since = datetime.fromtimestamp(stall["last_ts"] - (stall["seconds"] or 0), timezone.utc)
    doing = stall.get("doing") or "not in the trainer's own code"
    at = f" at {stall['at']}" if stall.get("at") else ""
    how = "" if stall.get("cleared") is None and stall.get("ended") is None else f", {stall_end_text(stall)}"
    reports = "its one stall report" if stall["reports"] == 1 else f"the last of {stall['reports']} stall reports"
    return (
        f"in {position(stall['state'], stall['step'])} since {since:%Y-%m-%d %H:%M:%S} UTC "
        f"({stall['seconds']:.1f} s at {reports}{how}): {doing}{at}"
    )


def _describe(record: Record, end: float) -> str:
    """``:118  -0.004s  step 5 ACCUMULATE transition trigger=micro source=STEP dest=ACCUMULATE``."""
    fields = " ".join(f"{key}={_short(value)}" for key, value in record.data.items() if key not in _COMMON)
    text = f":{record.line:<6} {record.ts - end:+9.3f}s  step {record.step} {record.state} {record.name}"
    return f"{text} {fields}" if fields else text


def _short(value: Any, limit: int = 120) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _next_attempt(report: AuditReport, number: int, requeue: dict[str, Any] | None = None) -> str:
    later = [a for a in report.attempts if a.attempt > number]
    if not later:
        if requeue is not None and requeue["ok"]:
            by = " by SLURM" if requeue.get("requeued_by") == "slurm" else ""
            return f"next: no later attempt in the trail yet; the job was requeued{by} and resumes when SLURM starts it"
        return "next: no later attempt in the trail"
    following = later[0]
    first = following.first
    checkpoints = following.as_dict()["checkpoints"]
    skipped = "".join(f"; skipped {c['path']} ({c['reason']})" for c in checkpoints["skipped"])
    if first.loaded:
        loaded = first.loaded[-1]
        what = f"resumed from checkpoint {loaded['path']} (step {loaded['step']})"
    elif first.start == "resume":
        what = f"resumed from step {first.resumed_from_step}"
    elif first.start == "launch":
        what = "started from scratch (no checkpoint loaded)"
    else:
        what = "ended before restoring anything"
    exit = first.exit
    if exit is not None:
        ending = f"it ended {exit['reason']} at step {first.end_step}"
    else:
        ending = f"it was killed too (no exit event), last seen in {position(first.end_state, first.end_step)}"
    restart = group_restart(first.torchelastic)
    if restart:
        what = f"(torchrun restart {restart}) {what}"
    return f"next: attempt {following.attempt} {what}{skipped}; {ending}"
