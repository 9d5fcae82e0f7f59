"""The audit trail: one JSON object per line, per rank, in ``WORKSPACE/logs/events.rank{R}.jsonl``.

Every event carries ``ts`` (seconds since the epoch), ``event``, ``rank``, ``step``, ``state``,
``run_id`` and ``attempt``. Event names and their fields are listed in ``EVENT_FIELDS``; the
``trainfsm`` command and the tests read the trail by these names.

The library never calls ``structlog.configure()``: that is the application's business. It wraps its
own sink with its own processors instead, so a user's structlog setup is untouched. People get a
readable rendering through the stdlib logger given to the trainer (``logging.getLogger("trainfsm")``
by default): decision events at INFO (WARNING/ERROR for problems), every transition at DEBUG.

Transitions are the hot path (two or more per optimizer step), so they are recorded as a tuple
(time, step, row) and rendered through the same structlog chain in batches: every ``BATCH``
transitions, and always before any other event, so the file's order is the order things happened.
Every non-transition event flushes the file: a process that is killed outright loses at most the
transitions since the last decision event, never a checkpoint, retry, signal or exit.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import IO, Any, Final

import structlog

try:  # orjson renders an event ~5x faster than json; both give the same JSON lines.
    import orjson

    def _dumps(event: MutableMapping[str, Any]) -> bytes:
        return orjson.dumps(event, default=str, option=orjson.OPT_APPEND_NEWLINE)

except ImportError:  # pragma: no cover - exercised where orjson is absent

    def _dumps(event: MutableMapping[str, Any]) -> bytes:
        return (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()


FORMAT_VERSION: Final = 1

#: Event name -> the fields it adds to the common ones. Decision events are INFO for people.
EVENT_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "run_start": ("format", "versions", "world_size", "max_steps", "config", "signals", "torchelastic"),
    "transition": ("trigger", "source", "dest"),
    "restore": ("resumed", "from_step"),
    "epoch": ("epoch",),
    "data_resumed": ("mode", "why", "epoch", "batches", "positioned", "seconds"),
    "data_exhausted": ("epochs", "dropped_micro_batches"),
    "metrics": ("values",),
    "loss_none": ("micro", "ranks"),
    "non_finite": ("what", "retry", "max", "scale"),
    "checkpoint_saved": (
        "path",
        "saved_step",
        "bytes",
        "seconds",
        "checksum",
        "kept",
        "asynchronous",
        "sharded",
        "direct_io",
    ),
    "checkpoint_loaded": ("path", "from_step", "sharded"),
    "checkpoint_skipped": ("path", "reason"),
    "checkpoint_pruned": ("paths",),
    "checkpoint_tmp_removed": ("names",),
    "checkpoint_store_ready": ("seconds",),
    "checkpoint_failed": ("type", "message"),
    "signal_received": ("signal", "received_at", "at_step", "at_state"),
    "signal_agreed": ("signal", "agreed_step"),
    "signal_passed_on": ("signal", "received_at", "at_state", "disposition"),
    "requeue": ("command", "ok", "message"),
    "wandb_run": ("wandb_id", "continued", "mode"),
    "early_stop": ("monitor", "best", "best_step", "bad_evaluations", "patience"),
    "cuda_memory_unavailable": ("device",),
    "collective_failed": ("note", "trails"),
    "group_outlives_destroy": ("cause",),
    "exception": ("type", "message", "traceback"),
    "exit": ("reason", "code"),
}

EXIT_REASONS: Final = ("completed", "preempted", "failed", "stopped", "interrupted")

#: Transitions rendered per batch. Rendering them in a burst keeps structlog's objects in cache;
#: one at a time between a step's kernels, each costs several times more.
BATCH: Final = 64

_CONSOLE_FIELDS_SKIPPED: Final = frozenset({"ts", "event", "rank", "run_id", "attempt", "traceback"})


class _FileSink:
    """structlog's final "logger": writes rendered lines; flushes all but transitions."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.debug = file.write  # transitions: buffered
        self.info = self.warning = self.error = self.critical = self._write_flush

    def _write_flush(self, line: bytes) -> None:
        self._file.write(line)
        self._file.flush()


class _NullSink:
    """Without a workspace: events reach the console only."""

    def _drop(self, line: bytes) -> None:
        return None

    debug = info = warning = error = critical = _drop


class EventLog:
    """The trainer's event writer: a bound structlog logger plus the file it writes to.

    ``log.debug("transition", ...)`` is the hot path: a filtering bound logger, a handful of
    processors that touch no strings, one orjson call and a buffered write.
    """

    def __init__(
        self,
        *,
        path: Path | None,
        console: logging.Logger | logging.LoggerAdapter[logging.Logger],
        rank: int,
        run_id: str,
        attempt: int,
        progress: Callable[[], tuple[int, str]],
        owner: Any = None,
    ) -> None:
        self.path = path
        self.console = console
        self._file: IO[bytes] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "ab", buffering=1 << 16)  # noqa: SIM115 - closed by close()
        self._progress = progress
        self._owner = owner  # has ``.step`` (the trainer): read directly on the per-step path
        self._console_debug = console.isEnabledFor(logging.DEBUG)
        self._pending: list[tuple[float, int, tuple[str, str, str]]] = []
        # People watching transitions on the console see them as they happen.
        self._batch = 1 if self._console_debug else BATCH
        processors: list[Any] = [self._drain_first, self._add_progress, self._to_console]
        if self._file is not None:
            processors.append(self._render)
        else:
            processors.append(self._discard)
        self.log: Any = structlog.wrap_logger(
            _FileSink(self._file) if self._file is not None else _NullSink(),
            processors=processors,
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            context_class=dict,
            cache_logger_on_first_use=True,
        ).bind(rank=rank, run_id=run_id, attempt=attempt)

    def transition_recorder(self, trigger: str, source: str, dest: str) -> Callable[[], None]:
        """The callable the machine runs at the instant it takes (trigger, source -> dest)."""
        row = (trigger, source, dest)
        pending, append, clock, owner = self._pending, self._pending.append, time.time, self._owner
        batch = self._batch

        def record() -> None:
            append((clock(), owner.step, row))  # the state is ``dest``: no need to read it
            if len(pending) >= batch:
                self.drain()

        return record

    def drain(self) -> None:
        """Render the recorded transitions, oldest first."""
        if not self._pending:
            return
        pending = self._pending.copy()
        self._pending.clear()
        debug = self.log.debug
        for ts, step, (trigger, source, dest) in pending:
            debug("transition", ts=ts, step=step, state=dest, trigger=trigger, source=source, dest=dest)

    def _drain_first(self, _: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if self._pending:  # earlier transitions are written before this event
            self.drain()
        return event

    def _add_progress(self, _: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if "ts" not in event:
            event["ts"] = time.time()
            event["step"], event["state"] = self._progress()
        return event

    def _to_console(self, _: Any, level: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if level == "debug" and not self._console_debug:
            return event
        levelno = logging.getLevelName(level.upper())
        if self.console.isEnabledFor(levelno):
            self.console.log(levelno, "%s", render_console(event))
        return event

    @staticmethod
    def _render(_: Any, __: str, event: MutableMapping[str, Any]) -> bytes:
        return _dumps(event)

    @staticmethod
    def _discard(_: Any, __: str, event: MutableMapping[str, Any]) -> bytes:
        return b""

    def flush(self) -> None:
        self.drain()
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        self.drain()
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None


def notice(console: logging.Logger | logging.LoggerAdapter[logging.Logger], text: str) -> None:
    """A line people must see (a resume, a preemption's save) even when nobody set up logging.

    When the trainer's logger shows INFO through some handler the event's own line already says
    it; otherwise (Python's default: WARNING and above only) this prints ``trainfsm: text`` to
    stderr once.
    """
    logger = console.logger if isinstance(console, logging.LoggerAdapter) else console
    if console.isEnabledFor(logging.INFO) and logger.hasHandlers():
        return
    print(f"trainfsm: {text}", file=sys.stderr, flush=True)


def render_console(event: MutableMapping[str, Any]) -> str:
    """One readable line: ``[rank 0] step 12 STEP checkpoint_saved path=... bytes=...``."""
    fields = " ".join(
        f"{key}={value}"
        for key, value in event.items()
        if key not in _CONSOLE_FIELDS_SKIPPED and key not in ("step", "state") and value is not None
    )
    head = f"[rank {event.get('rank', 0)}] step {event.get('step')} {event.get('state')} {event['event']}"
    return f"{head} {fields}" if fields else head


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def previous_attempt(path: Path) -> tuple[str, int] | None:
    """(run_id, attempt) of the last complete event in an existing trail, or None.

    Reads only the file's tail: trails of week-long runs are large. A truncated last line (a
    killed writer) is skipped.
    """
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - (1 << 16)))
        tail = f.read().splitlines()
    for line in reversed(tail):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "attempt" in event and "run_id" in event:
            return str(event["run_id"]), int(event["attempt"])
    return None
