"""Constructor argument checks and the constants they allow: each error names the argument, the
value and what is allowed.

The bottom room: it imports nothing of trainfsm's, and torch only inside the checks that need it
(``import trainfsm.options`` stays light for anything that only needs its constants).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch

#: ``mixed_precision``'s values besides None (``trainfsm.step`` maps them to dtypes).
MIXED_PRECISIONS: Final = ("fp16", "bf16")
#: The trail's forms: routine steps as ``steps`` records, or every transition verbatim (debugging).
TRAIL_FORMS: Final = ("compact", "full")
#: What the stall watchdog does after it recorded a stall: keep waiting, or end the process.
STALL_ACTIONS: Final = ("record", "exit")


def int_at_least(name: str, value: Any, minimum: int) -> int:
    """An int (not a bool) >= ``minimum``: TypeError for another type, ValueError when smaller."""
    return _int(name, value, minimum, "")


def count(name: str, value: Any, none_is: int = 0) -> int:
    """A whole number from ``none_is`` up (the least it means); None means ``none_is``."""
    if value is None:
        return none_is
    return _int(name, value, none_is, " or None")


def positive_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> int | None:
    if value is None and allow_none:
        return None
    return _int(name, value, minimum, " or None" if allow_none else "")


def _int(name: str, value: Any, minimum: int, or_none: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}{or_none}; got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{or_none}; got {value!r}.")
    return value


def grad_clip(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"grad_clip must be a positive float or None; got {value!r} ({type(value).__name__}).")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(
            f"grad_clip must be a positive finite float (the max total gradient norm) or None "
            f"to disable clipping; got {value!r}."
        )
    return float(value)


def mixed_precision(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or value not in MIXED_PRECISIONS):
        raise ValueError(f"mixed_precision must be one of 'fp16', 'bf16' or None; got {value!r}.")
    return value


def trail_form(value: Any) -> str:
    if not isinstance(value, str) or value not in TRAIL_FORMS:
        raise ValueError(
            f"trail_form must be one of {', '.join(map(repr, TRAIL_FORMS))}; got {value!r}. 'compact' writes "
            f"runs of routine steps as one record each, 'full' every transition (for debugging the trail)."
        )
    return value


def workspace(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"workspace must be a str, a path or None; got {value!r} ({type(value).__name__}).")
    if str(value) == "":
        raise ValueError("workspace must not be an empty string; pass None to write no files.")
    return Path(value)


def device(value: Any) -> torch.device:
    import torch

    if value is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, str, int or None; got {value!r} ({type(value).__name__}).")
    try:
        return torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"device {value!r} is not a valid torch device ({exc}); use e.g. 'cpu', 'cuda', 'cuda:1' or 0."
        ) from None


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r} ({type(value).__name__}).")
    return value


def state_dict_options(value: Any) -> Any:
    if value is None:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not isinstance(value, StateDictOptions):
        raise TypeError(
            f"state_dict_options must be a torch.distributed.checkpoint.state_dict.StateDictOptions "
            f"or None; got {value!r} ({type(value).__name__})."
        )
    return value


def logger(value: Any) -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    if value is None:
        return logging.getLogger("trainfsm")
    if not isinstance(value, (logging.Logger, logging.LoggerAdapter)):
        raise TypeError(f"logger must be a logging.Logger or None; got {value!r} ({type(value).__name__}).")
    return value


def built(method: str, value: Any, expected: type | tuple[type, ...], allow_none: bool = False) -> Any:
    """A build method's result: never None unless optional, and of the expected type."""
    if value is None and allow_none:
        return None
    if value is None:
        raise TypeError(f"{method}() returned None; it must return the built object (did you forget `return`?).")
    if not isinstance(value, expected):
        names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
        raise TypeError(f"{method}() must return a {names}; got {type(value).__name__}.")
    return value


def stall_timeout(value: Any) -> float | str | None:
    """``"auto"``, a positive number of seconds, or None (no watchdog)."""
    allowed = "'auto', a positive number of seconds or None (no watchdog)"
    return _auto_or_seconds("stall_timeout", value, allowed, zero=False)


def job_end_margin(value: Any) -> float | str | None:
    """``"auto"``, seconds >= 0, or None (the job's end is not watched)."""
    allowed = "'auto', a number of seconds >= 0 or None (do not watch the job's end)"
    return _auto_or_seconds("job_end_margin", value, allowed, zero=True)


def _auto_or_seconds(name: str, value: Any, allowed: str, *, zero: bool) -> float | str | None:
    if value is None or value == "auto":
        return None if value is None else "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {allowed}; got {value!r} ({type(value).__name__}).")
    above_minimum = value >= 0 if zero else value > 0
    if not (above_minimum and value < float("inf")):  # NaN fails both comparisons
        raise ValueError(f"{name} must be {allowed}; got {value!r}.")
    return float(value)


def stall_action(value: Any) -> str:
    if not isinstance(value, str) or value not in STALL_ACTIONS:
        raise ValueError(
            f"stall_action must be one of {', '.join(repr(a) for a in STALL_ACTIONS)} (record the stall and "
            f"keep waiting, or record it and end the process); got {value!r}."
        )
    return value
