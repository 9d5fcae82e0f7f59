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
  the message says why): nothing will resume the run;
- ``stalled``: in the last attempt a rank's stall watchdog ended the process (exit reason
  ``stalled``, code 75), or a rank's trail ends in a ``stall`` that never cleared (a run that hangs,
  or hung until something killed it, or until the collective it waited in failed at the process
  group's timeout: not cleared, and the rank's ``failed`` is told in it, as the stall's
  consequence). A stall that cleared is not a problem: the rank went on;
- ``ledger``: the data ledger (``trainfsm.tools.ledger``) found a micro-batch (or, across world
  sizes, a position of an epoch's order) kept twice or never, in any attempt: a resume that restored
  another position than its checkpoint saved, a loader that resumed elsewhere, a start from scratch
  after a complete save.

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

Each preempted attempt is timed (``trainfsm.tools.preemption_timing``): signal, step finished,
ranks agreed, checkpoint durable, exit, and under SLURM the margin left before the job's end; a
thin margin is a note (advice on the lead time), not a run problem.

``--json`` prints the report as one object, schema ``trainfsm.audit/1``: documented in
``trainfsm.tools.report``, which also renders it as text. One rank's attempt is replayed by
``trainfsm.tools.replay``; this module reads the trail (rank files side by side in worker processes
when it is large), then checks the attempts across ranks and says how the run ended.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Final

from trainfsm.machine import STALL_EXIT_CODE, ExitReason
from trainfsm.tools import ledger, preemption_timing
from trainfsm.tools.replay import Problem, RankAttempt, Replay
from trainfsm.tools.report import SCHEMA, AttemptReport, AuditReport, render
from trainfsm.tools.words import first_line, group_by, position, ranks_text, since_text
from trainfsm.trail.files import closed_segments
from trainfsm.trail.reader import Note, Record, Trail, TrailError, open_trail, read_records

__all__ = ["PROBLEM_KINDS", "RUN_PROBLEM_KINDS", "SCHEMA", "AuditReport", "Problem", "audit", "audit_trail", "render"]

PROBLEM_KINDS: Final = (
    "illegal_transition",
    "state_mismatch",
    "gap",
    "rank_disagreement",
    "malformed",
)
#: A failed or interrupted run (its exit reason), an attempt killed and not resumed, a refused requeue.
RUN_PROBLEM_KINDS: Final = (
    ExitReason.FAILED.value,
    ExitReason.INTERRUPTED.value,
    "killed",
    "requeue_refused",
    ExitReason.STALLED.value,
    ledger.KIND,
)


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
    replays: dict[tuple[int, int], Replay] = {}
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
    checked = ledger.check(attempts)
    trail.notes.extend(checked.notes)
    trail.notes.extend(preemption_timing.notes(attempts))  # thin margins: advice, not run problems
    run_problems = checked.problems + _run_problems(attempts)
    return AuditReport(files, attempts, problems, trail.notes, run_problems, checked.lines, checked.checked)


def _jobs(jobs: int | None, trail: Trail) -> int:
    if jobs is not None:
        if jobs < 1:
            raise ValueError(f"jobs must be a positive number of processes; got {jobs}")
        return min(jobs, len(trail.files))
    if len(trail.files) < 2 or sum(p.stat().st_size for f in trail.files for p in _parts_of(f)) < PARALLEL_BYTES:
        return 1
    return min(len(trail.files), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def _parts_of(path: Path) -> list[Path]:
    return [p for p in (*closed_segments(path), path) if p.exists()]


def _replay_alone(
    path: Path, observe: Callable[[Record], None] | None = None
) -> tuple[dict[str, Any], dict[tuple[int, int], Replay], list[Problem], list[Note]]:
    """One file's replays, problems and notes, on their own (in a worker process, or here)."""
    problems: list[Problem] = []
    notes: list[Note] = []
    replays: dict[tuple[int, int], Replay] = {}
    summary = _replay_file(path, notes, replays, problems, observe)
    for replay in replays.values():
        replay.problems = []  # they are in ``problems``: not sent back twice
    return summary, replays, problems, notes


def _replay_file(
    path: Path,
    notes: list[Note],
    replays: dict[tuple[int, int], Replay],
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
    current: Replay | None = None
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
    replays: dict[tuple[int, int], Replay],
    problems: list[Problem],
    latest: dict[int, int],
    origin: str,
) -> Replay:
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
        replay = replays[key] = Replay(record, problems, origin)
    elif replay.origin != origin:
        raise TrailError(
            f"{record.where()}: rank {record.rank}, attempt {record.attempt} is also in {replay.origin}; "
            f"pass one trail per rank"
        )
    return replay


def _attempts(replays: dict[tuple[int, int], Replay]) -> list[AttemptReport]:
    by_attempt: dict[int, list[RankAttempt]] = {}
    for (attempt, _), replay in sorted(replays.items()):
        by_attempt.setdefault(attempt, []).append(replay.result)
    return [AttemptReport(attempt, ranks) for attempt, ranks in sorted(by_attempt.items())]


def _check_attempt(attempt: AttemptReport, problems: list[Problem], notes: list[Note]) -> None:
    headless = [r.rank for r in attempt.ranks if r.run_id is None]
    if headless:
        notes.append(
            Note(f"{ranks_text(headless)}, attempt {attempt.attempt} has no run_start (the trail begins mid-attempt?)")
        )
    world = attempt.first.world_size
    present = [r.rank for r in attempt.ranks]
    if world is not None and len(present) < world:
        notes.append(Note(f"attempt {attempt.attempt}: world_size is {world}, but the trail has {ranks_text(present)}"))
    buckets = next((r.buckets_problem for r in attempt.ranks if r.buckets_problem), None)
    if buckets is not None:  # the same on every rank: noted once
        notes.append(
            Note(
                f"attempt {attempt.attempt}: DDP's bucket layout may differ from the saved run's ({buckets}): "
                f"with more than two ranks this resume is not bit-exact (docs/guides/distributed.md)"
            )
        )
    if len(attempt.ranks) > 1:
        if attempt.killed:
            notes.append(Note(f"attempt {attempt.attempt}: ranks not compared, as not every rank has an exit event"))
        elif any((r.exit or {}).get("reason") == ExitReason.STALLED for r in attempt.ranks):
            notes.append(Note(f"attempt {attempt.attempt}: ranks not compared, as the stall watchdog ended it"))
        else:
            _compare_ranks(attempt, problems)


def _run_problems(attempts: list[AttemptReport]) -> list[Problem]:
    """How the run did not end well. Only the last attempt counts: after a killed, failed,
    interrupted or unrequeued attempt, a later one means the run was resumed or restarted."""
    if not attempts:
        return []
    last = attempts[-1]
    found = []
    hung = {r.rank for r in last.ranks if r.stall_open is not None}  # alive and stuck, or killed stuck: "stalled"
    gone = [k for k in last.killed_at() if k["rank"] not in hung]
    for (state, step), killed in group_by(gone, lambda k: (k["state"], k["step"])).items():
        k = killed[0]
        since = since_text(k["since_previous"]) if len(killed) == 1 else ""
        found.append(
            Problem(
                "killed",
                f"attempt {last.attempt}: {ranks_text([x['rank'] for x in killed])} killed: no exit event, "
                f"{'its trail ends' if len(killed) == 1 else 'their trails end'} in {position(state, step)}{since}; "
                f"no later attempt resumed {'it' if len(killed) == 1 else 'them'}",
                k["file"],
                k["line"],
                k["rank"],
                last.attempt,
            )
        )
    for reason in (ExitReason.FAILED, ExitReason.INTERRUPTED):
        # A collective that failed in a stall is the stall's consequence: the stalled problem says it.
        ranks = [r for r in last.ranks if (r.exit or {}).get("reason") == reason and not _stall_failed(r)]
        if not ranks:
            continue
        r = ranks[0]
        code = (r.exit or {}).get("code")
        cause = f": {r.exceptions[0]['type']}: {first_line(r.exceptions[0]['message'])[:80]}" if r.exceptions else ""
        who = ranks_text([x.rank for x in ranks])
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
    stalled = [r for r in last.ranks if r.stall_open is not None or (r.exit or {}).get("reason") == ExitReason.STALLED]
    if stalled:
        found.append(_stalled_problem(last, stalled))
    requeue = last.first.requeue
    if requeue is not None and not requeue["ok"]:
        found.append(
            Problem(
                "requeue_refused",
                f"attempt {last.attempt}: the job was not requeued ({requeue['command'] or 'no command'}: "
                f"{first_line(requeue['message'])}); no later attempt: nothing will resume the run",
                last.first.file,
                last.first.requeue_line,
                last.first.rank,
                last.attempt,
            )
        )
    return found


def _stalled_problem(last: AttemptReport, stalled: list[RankAttempt]) -> Problem:
    """The stall of the last attempt, naming first the rank that holds the others: one stuck
    outside any collective, else (every stalled rank waits in one) a rank whose trail went quiet."""
    waiting = [r for r in stalled if (r.stall_open or (r.stalls[-1] if r.stalls else {})).get("collective")]
    stuck = [r for r in stalled if r not in waiting]
    quiet = [r for r in last.ranks if r not in stalled and r.exit is None]
    parts = []
    for r in stuck + waiting:
        stall = r.stall_open or (r.stalls[-1] if r.stalls else None)
        if stall is None:
            parts.append(f"rank {r.rank} in {position(r.end_state, r.end_step)}")
            continue
        doing = stall["doing"] or "not in the trainer's own code"
        where = position(stall["state"], stall["step"])
        parts.append(f"rank {r.rank} in {where} for {stall['seconds']:.1f} s: {doing}")
    if quiet and not stuck:
        parts.insert(0, f"{ranks_text([r.rank for r in quiet])} went quiet (frozen or killed) while the others waited")
    ended = [r for r in stalled if (r.exit or {}).get("reason") == ExitReason.STALLED]
    failed = [r for r in stalled if _stall_failed(r)]
    if ended:
        how = f"the stall watchdog ended {ranks_text([r.rank for r in ended])} (exit code {STALL_EXIT_CODE})"
    elif failed:
        codes = sorted({str((r.exit or {}).get("code")) for r in failed})
        how = (
            f"then the collective {ranks_text([r.rank for r in failed])} waited in failed (the process group's "
            f"timeout): exit {(failed[0].exit or {}).get('reason', 'none')} (code {', '.join(codes)})"
        )
    else:
        how = "the trail ends in the stall"
    first = (stuck + waiting)[0]
    stall = first.stall_open or (first.stalls[-1] if first.stalls else None)
    return Problem(
        ExitReason.STALLED.value,
        f"attempt {last.attempt} stalled: {'; '.join(parts)}; {how}; no later attempt (trainfsm trace tells more)",
        first.file,
        stall["line"] if stall is not None else first.exit_line,
        first.rank,
        last.attempt,
    )


def _stall_failed(r: RankAttempt) -> bool:
    """The rank's collective failed while it waited in a stall (``trainfsm.tools.stall_replay.collective_failed``)."""
    return r.stall_open is not None and r.stall_open.get("ended") == "collective_failed"


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
        for others in group_by(differing, lambda r, value=value: repr(value(r))).values():  # type: ignore[misc]
            other = others[0]
            problems.append(
                Problem(
                    "rank_disagreement",
                    f"attempt {attempt.attempt}: {label}: rank {reference.rank} {_show(expected)}, "
                    f"{ranks_text([r.rank for r in others])} {_show(value(other))}",
                    other.file,
                    other.exit_line,
                    other.rank,
                    attempt.attempt,
                )
            )


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 3:  # steps done
        first, last, done = value
        return f"{done} (steps {first}-{last})" if done else "0"
    return "none" if value is None or value == [] else str(value)


def _problem_order(problem: Problem) -> tuple[Any, ...]:
    return (problem.attempt if problem.attempt is not None else -1, problem.file or "", problem.line or 0)
