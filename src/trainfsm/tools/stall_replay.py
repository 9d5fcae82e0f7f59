"""The stall watchdog's events in a replay (``trainfsm.tools.replay``): each stall (its first
report, updated by the later ones), whether it cleared, and a stall that ended with its collective
failing (the process group's timeout): not cleared, the consequence of what held the rank up.
Handlers of ``Replay``'s table, called as its methods are (``handler(replay, record)``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainfsm.trail.reader import Record

if TYPE_CHECKING:
    from trainfsm.tools.replay import Replay


def stall(replay: Replay, record: Record) -> None:
    data = record.data
    report = {
        "rank": record.rank,
        "state": record.state,
        "step": record.step,
        "ts": record.ts,
        "seconds": data.get("seconds"),
        "doing": data.get("doing"),
        "collective": data.get("collective"),
        "hook": data.get("hook"),
        "at": innermost_own(data.get("stack") or []),
        "reports": data.get("report"),
        "line": record.line,
    }
    if replay.result.stall_open is not None and data.get("report", 1) > 1:
        replay.result.stall_open.update(
            seconds=report["seconds"],
            reports=report["reports"],
            last_ts=record.ts,
            doing=report["doing"],
            collective=report["collective"],
            at=report["at"],
        )
        return
    report["first_ts"] = report["last_ts"] = record.ts
    report["cleared"] = report["ended"] = None
    replay.result.stalls.append(report)
    replay.result.stall_open = report


def stall_cleared(replay: Replay, record: Record) -> None:
    stall = replay.result.stall_open
    if stall is not None and stall.get("ended") is not None:
        return  # the rank did not move on: its collective failed (``collective_failed``), still stalled
    if stall is not None:
        stall["cleared"] = record.data.get("seconds")
    replay.result.stall_open = None


def collective_failed(replay: Replay, record: Record) -> None:
    """A stall that waited in a collective ends when the collective fails (the process group's
    timeout, a peer that died): not cleared, the consequence of what held the rank up. The
    ``stall_cleared`` the watchdog then writes (the rank moved, to EXIT) leaves it open."""
    stall = replay.result.stall_open
    if stall is not None and stall.get("collective"):
        stall["ended"] = "collective_failed"


def innermost_own(stack: list[str]) -> str | None:
    """The innermost frame of a stall's stack that is the user's or the trainer's, not a library's
    (site-packages, the standard library, frozen imports): where to look first."""
    for frame in reversed(stack):
        if "site-packages" not in frame and "/lib/python" not in frame and not frame.startswith("<"):
            return frame
    return stack[-1] if stack else None
