"""Preemption timing for ``trainfsm audit``: how long each preemption's way out took and, under
SLURM, how much time was left before the job's end.

For each attempt that was preempted (some rank agreed on a signal or on the job's end, or exited
``preempted``), in seconds after the signal (the attempt's first ``signal_received`` on any rank;
for the trainer's own deadline, the moment it decided, ``deadline.decided_at``; for a preemption
rank 0 saw in the job's ``PreemptTime``, that time, when SLURM chose the job):

- **noticed**: a preemption seen in ``PreemptTime``: when the trainer took it (``preempted``);

- **step finished**: the agreed step's end, on the last rank that had the signal pending itself
  (``signal_agreed.step_ended_at``);
- **ranks agreed**: the last rank's ``signal_agreed``;
- **checkpoint durable**: the last ``checkpoint_saved`` of the agreed step;
- **process exit**: the last rank's ``exit`` event (the process ends just after it; with
  ``exit_wait`` and no requeue, that much later).

Under SLURM, the deadline is the one that applied, as rank 0 read the job after the signal
(``job_end``: ``kill_at``, when SLURM's SIGKILL may come: the grace time's end, the time limit, or
the signal itself when it was SLURM's kill, plus ``KillWait``; ``applied`` says which); for a trail
written before ``kill_at``, the job's end read after the signal, else the one of ``run_start``. The
*warning* is the deadline less the signal, the *margin* the deadline less the exit.

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
PREEMPTION_GUIDE: Final = "docs/guides/preemption.md#preemption-by-another-job"


def entry(ranks: list[RankAttempt]) -> dict[str, Any] | None:
    """The attempt's ``preemption`` entry of the audit's JSON; None when it was not preempted."""
    timing = [r.timing for r in ranks]
    agreed = [t["agreed_at"] for t in timing if "agreed_at" in t]
    if not agreed and not any((r.exit or {}).get("reason") == "preempted" for r in ranks):
        return None
    deadlines = [t["deadline"] for t in timing if "deadline" in t]
    preempted = next((t["preempted"] for t in timing if "preempted" in t), None)
    # No step agreed when the notice took the run out at the end of BUILD or RESTORE (``preempt``):
    # the ``preempted`` event alone says so, and a signal in the trail then is SLURM's after the requeue.
    if any(t.get("cause") == "preemption" for t in timing) or (not agreed and preempted is not None):
        cause = "preemption"
    elif deadlines or any(t.get("cause") == "deadline" for t in timing):
        cause = "deadline"
    else:
        cause = "signal"
    received = sorted((s for r in ranks for s in r.received), key=lambda s: s["ts"])
    first = ranks[0]
    if cause == "preemption" and preempted is not None:
        start: float | None = preempted["preempt_time"]
    elif deadlines:
        start = min(d["decided_at"] for d in deadlines)
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
    applied = (first.timing.get("job_end") or {}).get("applied") if read == "signal" else None

    def since(ts: float | None) -> float | None:
        return None if ts is None or start is None else round(ts - start, 3)

    if first.agreed:
        signal_name = first.agreed["signal"]
    else:  # left before training: a preemption seen in PreemptTime came with no signal of its own
        signal_name = received[0]["signal"] if received and cause != "preemption" else None
    return {
        "cause": cause,
        "signal": signal_name,
        "at": start,
        "at_step": received[0]["at_step"] if received and cause == "signal" else agreed_step,
        "agreed_step": agreed_step,
        "preempted": preempted,
        "noticed": since(preempted["noticed_at"]) if preempted else None,
        "step_finished": since(max(ended) if ended else None),
        "agreed": since(max(agreed) if agreed else None),
        "durable": since(max(durable) if durable else None),
        "exit": since(exit_at),
        "job_end": job_end,
        "job_end_read": read,
        "applied": applied,
        "kill_wait": (first.timing.get("job_end") or {}).get("kill_wait") if applied else None,
        "warning": since(job_end),
        "margin": None if job_end is None or exit_at is None else round(job_end - exit_at, 3),
        "save_after_end": bool(durable and job_end is not None and max(durable) > job_end),
        "deadline": deadlines[0] if deadlines else None,
    }


def _job_end(rank: RankAttempt) -> tuple[float | None, str | None]:
    """The deadline: the one that applied as read after the signal (``kill_at``), else (an older
    trail, or ``KillWait`` not known) the job's end read after it, else at ``run_start``; and which."""
    read = rank.timing.get("job_end") or {}
    if read.get("kill_at") is not None:
        return read["kill_at"], "signal"
    if read.get("end_time") is not None and "applied" not in read:  # a trail written before kill_at
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
    elif found["cause"] == "preemption":
        preempted = found["preempted"] or {}
        grace = preempted.get("grace_time")
        what = (
            f"SLURM preempted the job (PreemptMode={preempted.get('mode')}"
            + (f", GraceTime {grace:g} s" if grace is not None else "")
            + (f"; exit as {found['signal']}" if found["signal"] is not None else "")
            + ")"
        )
        if found["agreed_step"] is not None:
            what += f", agreed at step {found['agreed_step']}"
        else:  # taken at the end of BUILD or RESTORE, by ``preempt``
            what += ", taken before training (nothing to save)"
    else:
        what = f"{found['signal']} at step {found['at_step']}"
    marks = [
        (label, found[key])
        for label, key in (
            ("noticed", "noticed"),
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
        line += f"; deadline +{found['warning']:.1f} s ({_deadline_text(found)})"
        if found["margin"] is not None:
            line += f", margin {found['margin']:.1f} s at exit"
    return line


#: How each ``job_end.applied`` reads in the audit's preemption line.
_APPLIED: Final = {
    "grace_time": "the grace time's end",
    "kill_wait": "SLURM's kill had begun: the signal",
    "time_limit": "the time limit",
}


def _deadline_text(found: dict[str, Any]) -> str:
    if found["job_end_read"] != "signal":
        return "the job's end as at the start"
    applied = found["applied"]
    if applied is None:
        return "the job's end read after the signal"
    wait = found["kill_wait"]
    return str(_APPLIED.get(applied, applied)) + (
        f" + KillWait {wait:g} s" if wait is not None else ", KillWait not known"
    )


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
    if timing["cause"] == "deadline":
        return "deadline preemption"
    if timing["cause"] == "preemption":
        return "preemption by SLURM"
    return f"{timing['signal']} preemption"


def _advice(timing: dict[str, Any]) -> str:
    took = timing["exit"] if timing["exit"] is not None else timing["durable"]
    if timing["cause"] == "deadline":
        return "Give the trainer a larger job_end_margin (seconds) so that it leaves earlier."
    if timing["cause"] == "preemption" or timing["applied"] == "grace_time":
        return (
            f"Ask the cluster's admin for a longer GraceTime, or for the job's --signal at preemption "
            f"({PREEMPTION_GUIDE})."
        )
    if timing["applied"] == "kill_wait":
        return (
            "The signal was SLURM's kill, with only KillWait to save: ask for a --signal some time before the "
            f"time limit ({GUIDE}), and for the signal at preemption ({PREEMPTION_GUIDE})."
        )
    if took is None:
        return f"Ask SLURM for more lead time ({GUIDE})."
    lead = math.ceil(took / (1 - THIN_MARGIN))
    name = str(timing["signal"] or "USR1").removeprefix("SIG")
    return (
        f"The way out took {took:.1f} s: ask for at least --signal={name}@{lead}, more for a worse moment "
        f"(a step or an interval's save in the way: {GUIDE})."
    )
