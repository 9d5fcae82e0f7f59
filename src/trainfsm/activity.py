"""What a rank is doing, read from its main thread's stack: the stall watchdog's words for a wait.

A stalled rank is usually blocked in C (a collective, a file write, a queue ``get``), where no
mark set by the trainer could say more than the Python frames that called it. So nothing is marked
per step: each module registers, once at import, the functions whose frames name an activity
(``name(function, text)``), and ``describe`` walks the main thread's frames when a stall is
reported, innermost first, and names what it finds:

- ``collective``: the innermost registered wait among every rank (an all-reduce, a barrier, a
  gather), with the reason the trainer has it: "the step-end signal agreement (all-reduce)";
- ``doing``: every registered frame, innermost first, joined: "a barrier, in a checkpoint save,
  in hook CheckpointingHook.on_enter_checkpoint";
- ``hook``: the hook method running (``name_hook``: registered when the trainer builds its hooks),
  by its qualified name;
- ``stack``: the innermost frames as ``file:line function``, the user's included.

The registry is keyed by code object, so a lookup is a dict access per frame and a module only
registers its own functions (imports point down: this is room 0).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, Final

#: The innermost frames a stall event shows.
STACK_FRAMES: Final = 12

#: A registered frame's description: text, or a function of the frame and the frame it called
#: (None when it is the innermost Python frame: the thread is in C code called from it) that
#: returns the text and whether that is a wait for every rank.
Describe = str | Callable[[FrameType, "FrameType | None"], tuple[str, bool]]


@dataclass(frozen=True, slots=True)
class _Entry:
    describe: Describe
    collective: bool  # waits for every rank
    hook: bool  # a hook's method: named as the hook


_REGISTRY: dict[CodeType, _Entry] = {}


def name(function: Any, describe: Describe, *, collective: bool = False) -> None:
    """Name what ``function``'s frames are doing (``collective``: it waits for every rank)."""
    _REGISTRY[_code(function)] = _Entry(describe, collective, False)


def name_hook(method: Any) -> None:
    """A hook's method: its frames say which hook runs (``Class.method``)."""
    code = getattr(method, "__code__", None)  # a callable object or a partial names nothing
    if isinstance(code, CodeType) and code not in _REGISTRY:
        _REGISTRY[code] = _Entry(qualname(code), False, True)


def _code(function: Any) -> CodeType:
    code = getattr(function, "__code__", None) or getattr(getattr(function, "__func__", None), "__code__", None)
    if not isinstance(code, CodeType):
        raise TypeError(f"activity.name() takes a Python function; got {function!r}")
    return code


@dataclass(slots=True)
class Activity:
    """What a thread was doing when its stack was read."""

    doing: str | None = None
    collective: str | None = None
    hook: str | None = None
    stack: list[str] = field(default_factory=list)

    def as_event(self) -> dict[str, Any]:
        return {"doing": self.doing, "collective": self.collective, "hook": self.hook, "stack": self.stack}


def qualname(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+


def describe(frame: FrameType | None, frames: int = STACK_FRAMES) -> Activity:
    """Name what the thread whose innermost frame is ``frame`` is doing (see the module's docstring)."""
    activity = Activity()
    chain: list[FrameType] = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    parts: list[str] = []
    inner: FrameType | None = None
    for current in chain:  # innermost first
        entry = _REGISTRY.get(current.f_code)
        if entry is not None:
            if isinstance(entry.describe, str):
                text, collective = entry.describe, entry.collective
            else:
                text, collective = entry.describe(current, inner)
            if entry.hook:
                activity.hook = activity.hook or text
                text = f"hook {text}"
            elif collective and activity.collective is None:
                activity.collective = text
            parts.append(f"in {text}" if parts else text)
        inner = current
    activity.doing = ", ".join(parts) if parts else None
    activity.stack = [
        f"{f.f_code.co_filename}:{f.f_lineno} {qualname(f.f_code)}" for f in reversed(chain[:frames])
    ]  # outermost first, as a traceback prints them
    return activity


def main_thread_activity(frames: int = STACK_FRAMES) -> Activity:
    """``describe`` for the main thread, from another thread (the watchdog's)."""
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    return describe(frame, frames)
