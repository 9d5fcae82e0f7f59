"""Preemption timing for ``trainfsm audit``: how long each preemption's way out took and, under
SLURM, how much time was left before the job's end.

For each attempt that was preempted (some rank agreed on a signal or on the job's end, or exited
``preempted``), in seconds after the signal (the attempt's first ``signal_received`` on any rank;
for the trainer's own deadline, the moment it decided, ``deadline.decided_at``):

- **step finished**: the agreed step's end, on the last rank that had the signal pending itself
  (``signal_agreed.step_ended_at``);
- **ranks agreed**: the last rank's ``signal_agreed``;
- **checkpoint durable**: the last ``checkpoint_saved`` of the agreed step;
- **process exit**: the last rank's ``exit`` event (the process ends just after it; with
  ``exit_wait`` and no requeue, that much later).

Under SLURM, the job's end is the one rank 0 read after the signal (``job_end``; a preemption's
grace time moves it), else the one of ``run_start``. The *warning* is the job's end less the
signal, the *margin* the job's end less the exit.

A margin under ``THIN_MARGIN`` of the warning, or a checkpoint durable only after the job's end,
is a note, not a run problem. The run did not go wrong: the checkpoint is durable and the next
attempt resumes from it (an attempt SLURM killed before its exit has no ``exit`` event, which is
the ``killed`` run problem already when nothing resumed it). It says that the next preemption, a
little less lucky, would lose the save: the note gives the lead time to ask for.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

from trainfsm.trail.reader import Note

if TYPE_CHECKING:
    from trainfsm.tools.replay import RankAttempt
    from trainfsm.tools.report import AttemptReport

#: A margin under this share of the warning is worth a note.
THIN_MARGIN: Final = 0.25
GUIDE: Final = "docs/guides/preemption.md#how-much-lead-time"


def entry(ranks: list[RankAttempt]) -> dict[str, Any] | None:
    """The attempt's ``preemption`` entry of the audit's JSON; None when it was not preempted."""
    timing = [r.timing for r in ranks]
    agreed = [t["agreed_at"] for t in timing if "agreed_at" in t]
    if not agreed and not any((r.exit or {}).get("reason") == "preempted" for r in ranks):
        return None
    deadlines = [t["deadline"] for t in timing if "deadline" in t]
    cause = "deadline" if deadlines or any(t.get("cause") == "deadline" for t in timing) else "signal"
    received = sorted((s for r in ranks for s in r.received), key=lambda s: s["ts"])
    first = ranks[0]
    if deadlines:
        start: float | None = min(d["decided_at"] for d in deadlines)
    elif cause == "signal" and received:
        start = received[0]["ts"]
    else:
        start = None  # the deciding rank's trail is missing
    agreed_step = first.agreed["step"] if first.agreed else None
    ended = [t["step_ended_at"] for t in timing if t.get("step_ended_at") is not None]
    durable = [s["ts"] for r in ranks for s in r.saved if agreed_step is not None and s["step"] == agreed_step]
    exits = [t.get("exit_at") for t in timing]
    exit_at = max(exits) if exits and None not in exits else None  # type: ignore[type-var]
    job_end, read = _job_end(first)

    def since(ts: float | None) -> float | None:
        return None if ts is None or start is None else round(ts - start, 3)

    return {
        "cause": cause,
        "signal": first.agreed["signal"] if first.agreed else received[0]["signal"] if received else None,
        "at": start,
        "at_step": received[0]["at_step"] if received and cause == "signal" else agreed_step,
        "agreed_step": agreed_step,
        "step_finished": since(max(ended) if ended else None),
        "agreed": since(max(agreed) if agreed else None),
        "durable": since(max(durable) if durable else None),
        "exit": since(exit_at),
        "job_end": job_end,
        "job_end_read": read,
        "warning": since(job_end),
        "margin": None if job_end is None or exit_at is None else round(job_end - exit_at, 3),
        "save_after_end": bool(durable and job_end is not None and max(durable) > job_end),
        "deadline": deadlines[0] if deadlines else None,
    }


def _job_end(rank: RankAttempt) -> tuple[float | None, str | None]:
    """The job's end: as read after the signal, else at ``run_start``; and which."""
    read = rank.timing.get("job_end") or {}
    if read.get("end_time") is not None:
        return read["end_time"], "signal"
    at_start = rank.timing.get("job_end_at_start")
    return (at_start, "start") if at_start is not None else (None, None)


def text(found: dict[str, Any]) -> str:
    """The attempt's one line: what came, then each mark in seconds after it, then the margin."""
    if found["cause"] == "deadline":
        deadline = found["deadline"] or {}
        what = f"the job's end (exit as {found['signal']}), decided at step {found['agreed_step']}"
        if deadline:
            what += f" with {deadline['left']:.1f} s left for a way out of {deadline['needed']:.1f} s"
    else:
        what = f"{found['signal']} at step {found['at_step']}"
    marks = [
        (label, found[key])
        for label, key in (
            ("step finished", "step_finished"),
            ("ranks agreed", "agreed"),
            ("checkpoint durable", "durable"),
            ("exit", "exit"),
        )
        if found[key] is not None
    ]
    line = f"  preemption: {what}" + ("; " + ", ".join(f"{label} +{s:.2f} s" for label, s in marks) if marks else "")
    if found["at"] is None:
        line += " (the signal's time is not in the trail)"
    if found["job_end"] is not None and found["warning"] is not None:
        read = "read after the signal" if found["job_end_read"] == "signal" else "as at the start"
        line += f"; job end +{found['warning']:.1f} s ({read})"
        if found["margin"] is not None:
            line += f", margin {found['margin']:.1f} s at exit"
    return line


def notes(attempts: list[AttemptReport]) -> list[Note]:
    """A note per preemption whose margin was thin or whose save ended after the job's end."""
    found = []
    for attempt in attempts:
        timing = entry(attempt.ranks)
        if timing is None or timing["job_end"] is None:
            continue
        first = attempt.first
        where = (first.file, first.exit_line)
        label = f"attempt {attempt.attempt}: the {_what(timing)}"
        if timing["save_after_end"]:
            late = timing["durable"] - timing["warning"]
            found.append(
                Note(
                    f"{label}'s checkpoint (step {timing['agreed_step']}) became durable {late:.1f} s after the "
                    f"job's end: SLURM may kill a save that runs past it. {_advice(timing)}",
                    *where,
                )
            )
        elif timing["margin"] is not None and timing["warning"] and timing["margin"] < THIN_MARGIN * timing["warning"]:
            found.append(
                Note(
                    f"{label} left {timing['margin']:.1f} s before the job's end at exit, under "
                    f"{THIN_MARGIN:.0%} of its {timing['warning']:.1f} s warning. {_advice(timing)}",
                    *where,
                )
            )
    return found


def _what(timing: dict[str, Any]) -> str:
    return "deadline preemption" if timing["cause"] == "deadline" else f"{timing['signal']} preemption"


def _advice(timing: dict[str, Any]) -> str:
    took = timing["exit"] if timing["exit"] is not None else timing["durable"]
    if timing["cause"] == "deadline":
        return "Give the trainer a larger job_end_margin (seconds) so that it leaves earlier."
    if took is None:
        return f"Ask SLURM for more lead time ({GUIDE})."
    lead = math.ceil(took / (1 - THIN_MARGIN))
    name = str(timing["signal"] or "USR1").removeprefix("SIG")
    return (
        f"The way out took {took:.1f} s: ask for at least --signal={name}@{lead}, more for a worse moment "
        f"(a step or an interval's save in the way: {GUIDE})."
    )
