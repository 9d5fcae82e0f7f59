"""The audit trail's writer: ``EventLog``, one JSON object per line, per rank (the schema, the
event names and their fields, is ``trainfsm.trail.schema``; the reader ``trainfsm.trail.reader``).

The library never calls ``structlog.configure()``: that is the application's business. It wraps its
own sink with its own processors instead, so a user's structlog setup is untouched. People read the
events through the stdlib logger given to the trainer (``trainfsm.trail.console``: a sentence each at
INFO, WARNING or ERROR; the fields, and every transition, at DEBUG).

Transitions are the hot path (two or more per optimizer step). A routine step (the machine's
``ROUTINE_*`` rows, nothing else happening) is written as part of one compact ``steps`` record per
run of such steps: about 7 bytes a step before compression, and replayed by ``trainfsm audit`` as
the rows it stands for. Everything else is written verbatim, in the order it happened; a
``form="full"`` log writes every transition verbatim (for debugging the trail itself).

What a process killed outright (SIGKILL, the OOM killer, a lost node) loses is bounded: every
non-transition event flushes the file, and at each step's end whatever was recorded is written
out once ``FLUSH_SECONDS`` passed since the last write. The trail is at most one step behind the
step in flight, or under a second behind the kill for shorter steps (``tests/faults/trail_lag.py``
measures it). The file rotates into compressed segments (``trainfsm.trail.files``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, MutableMapping
from itertools import pairwise
from pathlib import Path
from typing import IO, Any, Final

import structlog

from trainfsm.machine import ROUTINE_END, ROUTINE_NEXT, ROUTINE_START
from trainfsm.trail import console as people
from trainfsm.trail.console import render_console as render_console  # the stall watchdog's last words
from trainfsm.trail.files import (
    SEGMENT_BYTES,
    FileSink,
    NullSink,
    compress,
    next_number,
    segment_path,
    unfinished,
)
from trainfsm.trail.schema import BY, WATCHDOG, transition_event

try:  # orjson renders an event ~5x faster than json; both give the same JSON lines.
    import orjson

    def _dumps(event: MutableMapping[str, Any]) -> bytes:
        return orjson.dumps(event, default=str, option=orjson.OPT_APPEND_NEWLINE)

except ImportError:  # pragma: no cover - exercised where orjson is absent

    def _dumps(event: MutableMapping[str, Any]) -> bytes:
        return (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()


#: Verbatim transitions rendered per batch. Rendering them in a burst keeps structlog's objects in
#: cache; one at a time between a step's kernels, each costs several times more.
BATCH: Final = 64

#: What a SIGKILL may cost: at a step's end, what was recorded is written out once this many
#: seconds passed since the last write. Steps longer than this are written as each ends (the
#: trail is one step behind the step in flight), shorter ones at most this long plus one step
#: after they ended (under a second). No thread: a clock read per step, a write per interval.
FLUSH_SECONDS: Final = 0.5

_START, _NEXT, _END = ROUTINE_START, ROUTINE_NEXT, ROUTINE_END


class _Run:
    """Consecutive routine steps first..last of ``micro`` micro-batches, not yet written:
    ``times`` holds the first step's start and every step's end (the ``dt`` are taken when the
    record is rendered, so a step only appends its end)."""

    __slots__ = ("first", "last", "micro", "times")

    def __init__(self, step: int, micro: int, start: float, end: float) -> None:
        self.first = self.last = step
        self.micro = micro
        self.times = [start, end]


class EventLog:
    """The trainer's event writer: a bound structlog logger plus the file it writes to.

    Transitions are the hot path (two or more per optimizer step). In the compact form a routine
    step (``ROUTINE_START``, ``ROUTINE_NEXT`` x n, ``ROUTINE_END`` with nothing else in between)
    costs two clock reads and a few list appends: it joins the open run of such steps, which is
    written as one ``steps`` record when something else is written or ``FLUSH_SECONDS`` passed.
    Every other transition is recorded as (time, step, row) and rendered verbatim in batches,
    always before any other event, so the file's order is the order things happened.

    Threads: a routine step's rows are appended without a lock (atomic under the GIL); whatever
    takes from what was recorded, folds a step into the open run, or writes the file holds
    ``_lock``: once per step, uncontended, except when the stall watchdog takes the trail over
    (``write_out_before_exit``) while the trainer's thread is slow but not stuck.
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
        form: str = "compact",
        segment_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._clock = clock  # wall time; benchmarks/trail.py simulates week-long runs with its own
        self.console = console
        self.form = form
        self._common = {"rank": rank, "run_id": run_id, "attempt": attempt}
        self._file: IO[bytes] | None = None
        self.segment_bytes = segment_bytes or SEGMENT_BYTES
        self._compressing: threading.Thread | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "ab", buffering=1 << 16)  # noqa: SIM115 - closed by close()
            self._compress_later(unfinished(path))  # a killed predecessor's
        self._progress = progress
        self._owner = owner  # has ``.step`` (the trainer): read directly on the per-step path
        self._console_debug = console.isEnabledFor(logging.DEBUG)
        # Rendered ``steps`` records (bytes) and verbatim transitions (ts, step, row[, shown]).
        self._pending: list[tuple[Any, ...] | bytes] = []
        self._step_rows: list[tuple[float, int, tuple[str, str, str]]] = []  # the routine step in flight
        self._run: _Run | None = None
        self._last_write = clock()
        self._lock = threading.Lock()
        self._handed_over = False
        self.previous_end: dict[str, Any] | None = None  # the previous attempt's last event (open_trail)
        # People watching transitions on the console see them as they happen.
        self._batch = 1 if self._console_debug else BATCH
        processors: list[Any] = [self._drain_first, self._add_progress, self._to_console]
        if self._file is not None:
            processors.append(self._render)
            self._sink: FileSink | None = FileSink(self._file, self._lock, self._flushed)
        else:
            processors.append(self._discard)
            self._sink = None
        self.log: Any = structlog.wrap_logger(
            self._sink if self._sink is not None else NullSink(),
            processors=processors,
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            context_class=dict,
            cache_logger_on_first_use=True,
        ).bind(**self._common)

    # ---------------------------------------------------------------- recording transitions
    def transition_recorder(self, trigger: str, source: str, dest: str) -> Callable[[], None]:
        """The callable the machine runs at the instant it takes (trigger, source -> dest)."""
        row = (trigger, source, dest)
        if self.form == "compact":
            if row in (_START, _NEXT):
                return self._routine_recorder(_START if row == _START else _NEXT)
            if row == _END:
                return self._routine_end
        pending, append, clock, owner = self._pending, self._pending.append, self._clock, self._owner
        batch = self._batch

        def record() -> None:
            now = clock()
            with self._lock:
                if self._run is not None or self._step_rows:
                    self._spill()
                append((now, owner.step, row))  # the state is ``dest``: no need to read it
                if now - self._last_write >= FLUSH_SECONDS or now < self._last_write:
                    self._write_out()
                elif len(pending) >= batch:
                    self._drain()

        return record

    def _routine_recorder(self, row: tuple[str, str, str]) -> Callable[[], None]:
        append, clock, owner = self._step_rows.append, self._clock, self._owner
        if self._console_debug:  # people watching see each transition as it happens

            def record_and_show() -> None:
                append((now := clock(), owner.step, row))
                self._show(now, owner.step, row)

            return record_and_show

        def record() -> None:
            append((clock(), owner.step, row))

        return record

    def _show(self, ts: float, step: int, row: tuple[str, str, str]) -> None:
        trigger, source, dest = row
        event = {"event": "transition", "rank": self._common["rank"], "step": step, "state": dest}
        self.console.debug("%s", people.details({**event, "trigger": trigger, "source": source, "dest": dest}))

    def _routine_end(self) -> None:
        """A step left ACCUMULATE by ``stepped``: fold it into the open run if it was routine."""
        now = self._clock()
        step = self._owner.step
        if self._console_debug:
            self._show(now, step, _END)
        with self._lock:  # the stall watchdog may be taking the step's rows and the run
            rows = self._step_rows
            if rows and rows[0][2] is _START:
                run = self._run
                if run is not None and run.micro == len(rows) and run.last + 1 == step:
                    run.times.append(now)
                    run.last = step
                else:
                    if run is not None:
                        self._pending.append(self._render_run(run))
                    self._run = _Run(step, len(rows), rows[0][0], now)
                rows.clear()
            else:  # part of the step was written already (an event came in between): verbatim
                rows.append((now, step, _END))
                self._spill()
            if now - self._last_write >= FLUSH_SECONDS or now < self._last_write:
                self._write_out()

    def _spill(self) -> None:
        """The open run as its record, then the step in flight's rows verbatim, into ``_pending``
        (with the lock held)."""
        if self._run is not None:
            self._pending.append(self._render_run(self._run))
            self._run = None
        rows = self._step_rows
        if rows:
            # Taken as a slice, then deleted by count: the trainer's thread appends its rows
            # without the lock, and a row it appends between the two stays for the next spill.
            taken = rows[:]
            del rows[: len(taken)]
            if self._console_debug:  # shown as they happened: not again
                self._pending.extend((*row, True) for row in taken)
            else:
                self._pending.extend(taken)

    def _render_run(self, run: _Run) -> bytes:
        times = run.times
        return _dumps(
            {
                "ts": times[-1],
                "event": "steps",
                **self._common,
                "step": run.last,
                "state": _END[2],
                "first": run.first,
                "micro": run.micro,
                "dt": [round((end - start) * 1e6) for start, end in pairwise(times)],
            }
        )

    # ---------------------------------------------------------------- writing
    def drain(self) -> None:
        """Write everything recorded (runs as ``steps`` records, other transitions verbatim) to
        the file's buffer, oldest first, and show on the console at DEBUG what it has not shown."""
        with self._lock:
            self._drain()

    def _drain(self) -> None:
        self._spill()
        if not self._pending:
            return
        pending = self._pending.copy()
        self._pending.clear()
        write = self._file.write if self._file is not None else None
        show = self._console_debug
        common = self._common
        for item in pending:
            if isinstance(item, bytes):
                if write is not None:
                    write(item)
                continue
            ts, step, row = item[0], item[1], item[2]  # (ts, step, row) or (ts, step, row, shown)
            trigger, source, dest = row
            if show and len(item) == 3:
                self._show(ts, step, row)
            if write is not None:
                write(_dumps(transition_event(ts, step, trigger, source, dest, common)))

    def write_out(self) -> None:
        """Drain and flush to the file (the bound on what a SIGKILL loses); rotate when it is full."""
        with self._lock:
            self._write_out()

    def _write_out(self) -> None:
        self._drain()
        self._last_write = self._clock()
        file = self._file
        if file is None:
            return
        file.flush()
        if file.tell() >= self.segment_bytes:
            self._rotate()

    def _flushed(self) -> None:
        """A decision event was written and flushed (with the lock held)."""
        self._last_write = self._clock()
        if self._file is not None and self._file.tell() >= self.segment_bytes:
            self._rotate()

    def _rotate(self) -> None:
        """Close the full file as the next segment, compress it on a thread, write on in a new one."""
        assert self.path is not None and self._file is not None and self._sink is not None
        self._file.close()
        closed = segment_path(self.path, next_number(self.path))
        os.replace(self.path, closed)
        self._file = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115 - closed by close()
        self._sink.retarget(self._file)
        self._compress_later([closed])

    def _compress_later(self, plain: list[Path]) -> None:
        if not plain:
            return
        previous = self._compressing

        def work() -> None:
            if previous is not None:
                previous.join()
            for path in plain:
                compress(path)

        self._compressing = threading.Thread(target=work, name="trainfsm-trail-compress", daemon=True)
        self._compressing.start()

    # ---------------------------------------------------------------- structlog processors
    def _drain_first(self, _: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if self._pending or self._run is not None or self._step_rows:  # earlier records first
            self.drain()
        return event

    def _add_progress(self, _: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if "ts" not in event:
            event["ts"] = self._clock()
            event["step"], event["state"] = self._progress()
        return event

    def _to_console(self, _: Any, level: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        extra = event.pop(people.CONSOLE_ONLY, None)  # the console's alone, not the trail's
        if level != "debug" or self._console_debug:
            people.show(self.console, event, logging.getLevelName(level.upper()), extra)
        return event

    @staticmethod
    def _render(_: Any, __: str, event: MutableMapping[str, Any]) -> bytes:
        return _dumps(event)

    @staticmethod
    def _discard(_: Any, __: str, event: MutableMapping[str, Any]) -> bytes:
        return b""

    def write_from_thread(self, level: str, event: str, step: int, state: str, **fields: Any) -> None:
        """An event from another thread (the stall watchdog) while the trainer's thread is stuck:
        ``thread_record``, ``write_line`` (the trail first: the console may be the stuck stream),
        then ``show``."""
        record = self.thread_record(event, step, state, **fields)
        self.write_line(record)
        self.show(level, record)

    def thread_record(self, event: str, step: int, state: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": self._clock(), "event": event, **self._common, "step": step, "state": state, **fields}
        record[BY] = WATCHDOG
        return record

    def write_line(self, record: dict[str, Any]) -> None:
        """Write and flush one line from another thread, past the in-memory queue, which is the
        trainer's thread's. The file object serializes the two threads' writes line by line. Such an
        event may precede in the file transitions the trainer's thread recorded but had not written
        yet (the step in flight, or under ``FLUSH_SECONDS`` of steps): the reader takes it as out of
        band (``trainfsm.trail.schema.OUT_OF_BAND``), and its own ``step`` and ``state`` say where the
        trainer was."""
        line = _dumps(record)
        for _ in range(200):
            file = self._file
            if file is None:  # closed: the trainer's thread reached the end after all
                return
            try:
                file.write(line)
                file.flush()
                return
            except ValueError:  # closed by a rotation between reading _file and writing: the next one
                time.sleep(0.005)

    def show(self, level: str, record: dict[str, Any]) -> None:
        people.show(self.console, record, logging.getLevelName(level.upper()))

    def write_out_before_exit(self, timeout: float = 2.0) -> bool:
        """From another thread, just before it ends the process (the stall watchdog's ``exit``):
        take the trail over and write out what the trainer's thread recorded, so the trail goes up
        to where it stuck rather than losing its last steps as a SIGKILL would.

        The lock is taken with ``timeout`` (False: the trainer's thread holds it, stuck in a write
        of its own; nothing is written out) and kept: a trainer's thread that was only slow waits
        at its next write, so nothing it recorded is written twice or lost before the handover,
        and no line of its follows the caller's last ones. ``hand_back`` returns it (tests)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._handed_over = True
        with contextlib.suppress(Exception):  # a trail that cannot be written must not keep the process alive
            self._write_out()
        return True

    def hand_back(self) -> None:
        """Undo ``write_out_before_exit`` (for a caller whose process did not end after all)."""
        if self._handed_over:
            self._handed_over = False
            self._lock.release()

    def exception(self, exc: BaseException) -> None:
        """The ``exception`` event, with the full traceback (a failure in ``train()`` or in EXIT)."""
        self.log.error(
            "exception", type=type(exc).__name__, message=str(exc), traceback="".join(traceback.format_exception(exc))
        )

    def close(self) -> None:
        with self._lock:
            self._drain()
            if self._file is not None:
                self._file.flush()
                self._file.close()
                self._file = None
        if self._compressing is not None:
            self._compressing.join()
            self._compressing = None
