"""How the trail's events reach people: the stdlib logger given to the trainer
(``logging.getLogger("trainfsm")`` by default), never configured here.

At INFO and above the console reads like a log: each event a person should see is one sentence
(``trainfsm.trail.sentences``), at most ``WIDTH`` characters. Rank 0 speaks for all ranks; another
rank speaks only of what is its own (``OWN``: a stall, a failure, an exception). Everything else,
and every event's fields as the trail holds them, shows at DEBUG: ``logging.getLogger("trainfsm")
.setLevel(logging.DEBUG)`` widens it, ``.setLevel(logging.WARNING)`` leaves problems only.
No torch and no structlog here.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Final

from trainfsm.trail.sentences import SENTENCES

Console = logging.Logger | logging.LoggerAdapter[logging.Logger]

#: A sentence's most characters (a logging format's time stamp still fits in 120).
WIDTH: Final = 96

#: A field an emitter may add for the console's sentence alone; the writer takes it out before the
#: trail (``checkpoint_saved``'s line names the checkpoints its save pruned: one line per save).
CONSOLE_ONLY: Final = "console"

#: Events every rank speaks of at INFO and above: each is this rank's own.
OWN: Final = frozenset(
    {
        "stall",
        "stall_cleared",
        "exception",
        "collective_failed",
        "checkpoint_failed",
        "restart_stop",
        "launcher_stop",
        "signal_passed_on",
    }
)

#: Events the trail needs and people do not: their sentence shows at DEBUG only.
QUIET: Final = frozenset({"run_start", "checkpoint_not_loaded", "checkpoint_pruned", "job_end", "loss_none"})

#: Fields ``details`` leaves out: the head says them, or they are too long for a line.
_FIELDS_SKIPPED: Final = frozenset(
    {"ts", "event", "rank", "run_id", "attempt", "traceback", "stack", "by", "step", "state"}
)


def show(console: Console, event: MutableMapping[str, Any], levelno: int, extra: dict[str, Any] | None = None) -> None:
    """Log ``event``, recorded at ``levelno``: its sentence at the level people see it at (with
    ``extra``, the emitter's ``CONSOLE_ONLY`` fields), then its fields at DEBUG."""
    if not (console.isEnabledFor(levelno) or console.isEnabledFor(logging.DEBUG)):
        return
    for level, text in lines(event, levelno, extra):
        if console.isEnabledFor(level):
            console.log(level, "%s", text)


def lines(event: MutableMapping[str, Any], levelno: int, extra: dict[str, Any] | None = None) -> list[tuple[int, str]]:
    text = sentence({**event, **extra} if extra else event)
    if text is None:  # the trail's alone: its fields at DEBUG; another application's event as it was logged
        return [(logging.DEBUG if event.get("event") in SENTENCES else levelno, details(event))]
    return [(levelno if speaks(event, levelno) else logging.DEBUG, text), (logging.DEBUG, details(event))]


def own(event: MutableMapping[str, Any]) -> bool:
    """Whether every rank speaks of ``event``: a stall, a failure, an exception of its own."""
    name = event.get("event")
    return name in OWN or (name == "exit" and event.get("reason") in ("failed", "stalled"))


def speaks(event: MutableMapping[str, Any], levelno: int) -> bool:
    """Whether this rank's sentence shows at its level (else at DEBUG)."""
    if event.get("event") in QUIET:
        return False
    return event.get("rank", 0) == 0 or own(event) or levelno >= logging.ERROR


def sentence(event: MutableMapping[str, Any]) -> str | None:
    """The event's sentence, ``[rank R]`` first where another rank or a rank's own speaks; None
    for an event with none (the trail's alone, or another application's: its fields show)."""
    render = SENTENCES.get(str(event.get("event")))
    if render is None:
        return None
    try:
        text = render(event)
    except Exception:  # a console that cannot say it must not stop the run: its fields show
        return None
    if text is None:
        return None
    rank = event.get("rank", 0)
    if rank != 0 or own(event):
        text = f"[rank {rank}] {text}"
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."


def details(event: MutableMapping[str, Any]) -> str:
    """The event as the trail holds it, in one line: ``[rank 0] step 12 CHECKPOINT checkpoint_saved
    path=... bytes=...`` (DEBUG)."""
    fields = " ".join(
        f"{key}={value}" for key, value in event.items() if key not in _FIELDS_SKIPPED and value is not None
    )
    head = f"[rank {event.get('rank', 0)}] step {event.get('step')} {event.get('state')} {event['event']}"
    stack = event.get("stack")
    if stack:  # a stall: the innermost frame, not the whole stack
        fields = f"{fields} at={stack[-1]}"
    return f"{head} {fields}" if fields else head


def render_console(event: MutableMapping[str, Any]) -> str:
    """One line for ``event``: its sentence, else its fields (the stall watchdog's last words)."""
    return sentence(event) or details(event)


def notice(console: Console, text: str) -> None:
    """A line people must see (a resume, a preemption's save) even when nobody set up logging.

    When the trainer's logger shows INFO through some handler the event's own line already says
    it; otherwise (Python's default: WARNING and above only) this prints ``trainfsm: text`` to
    stderr once.
    """
    logger = console.logger if isinstance(console, logging.LoggerAdapter) else console
    if console.isEnabledFor(logging.INFO) and logger.hasHandlers():
        return
    print(f"trainfsm: {text}", file=sys.stderr, flush=True)
