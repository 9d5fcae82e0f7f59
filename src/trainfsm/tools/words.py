"""The words ``trainfsm audit`` and ``trainfsm trace`` share: where a rank is (one wording for
both, so a step reads the same in each), how a stall ended, ranks as ranges, a requeue's outcome."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from trainfsm import machine as fsm

#: States in which the trainer's step is the step being run (it went up on entering STEP).
RUNNING: Final = frozenset({fsm.STEP, fsm.ACCUMULATE, fsm.RETRY})


def position(state: str, step: int) -> str:
    """``STEP running step 1285``, ``CHECKPOINT at step 1284``: where a rank is or a trail ends,
    ``step`` the trainer's step there (``RankAttempt.end_step``, a stall's ``step``), worded by what
    it means in ``state``; ``audit`` and ``trace`` word every step of a state so."""
    return f"{state} running step {step}" if state in RUNNING else f"{state} at step {step}"


def stall_end_text(stall: dict[str, Any]) -> str:
    """How a stall ended: ``cleared after 4.2 s`` (the rank moved on), ``not cleared: the collective
    it waited in failed`` (the process group's timeout: a consequence of the stall), ``never cleared``."""
    if stall.get("ended") == "collective_failed":
        return "not cleared: the collective it waited in failed (the process group's timeout, or a peer gone)"
    return f"cleared after {stall['cleared']:.1f} s" if stall.get("cleared") is not None else "never cleared"


def group_by(items: Iterable[Any], key: Callable[[Any], Any]) -> dict[Any, list[Any]]:
    """Items by ``key``, groups in order of first appearance."""
    groups: dict[Any, list[Any]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def ranks_text(ranks: list[int]) -> str:
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


def first_line(text: Any) -> str:
    """The first line of a message (an exception's, a command's), "" for none."""
    lines = str(text).splitlines()
    return lines[0] if lines else ""


def since_text(seconds: float | None) -> str:
    """``, 1.25 s after the record before it`` (of a killed rank's last record); "" when unknown."""
    return "" if seconds is None else f", {seconds:.2f} s after the record before it"


def requeue_text(requeue: dict[str, Any]) -> str:
    """``done``, ``done by SLURM`` (it had requeued the job itself) or ``FAILED``."""
    if not requeue["ok"]:
        return "FAILED"
    return "done by SLURM" if requeue.get("requeued_by") == "slurm" else "done"
