"""A rank's trail on disk: the file being written and the closed, compressed segments before it.

A week-long run must not grow one file without bound, so the writer closes the file it writes
once it passes ``SEGMENT_BYTES`` and starts a new one:

    logs/events.rank0.00001.jsonl.gz   the first closed segment, compressed
    logs/events.rank0.00002.jsonl.gz
    logs/events.rank0.jsonl            the file being written (always this name)

Closing is a rename (``events.rank0.jsonl`` -> ``events.rank0.00003.jsonl``), then a thread
compresses the closed segment to ``.gz.tmp``, renames it to ``.gz`` and deletes the plain one. A
process killed in between leaves the plain segment (complete, and read in preference to a ``.gz``
beside it) and perhaps a ``.tmp`` (ignored); the next process on that trail finishes the job.

gzip, not zstd: on these trails (JSON lines of compact step records) gzip level 6 and zstd level 3
compress to within a few percent of each other (``benchmarks/trail.py`` prints both), compression
runs on a thread outside the step, and gzip needs nothing beyond the standard library to read:
``zcat`` on any machine, and ``trainfsm audit`` without an extra package. Stdlib only here, so the
offline commands stay light. ``FileSink`` is the writer's structlog "logger": the lines go to the
file through it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Final

#: The file being written is closed and compressed once it holds this many bytes.
SEGMENT_BYTES: Final = 64 << 20
COMPRESSED: Final = ".gz"
GZIP_LEVEL: Final = 6

_ACTIVE: Final = re.compile(r"^events\.rank(\d+)\.jsonl$")
_SEGMENT: Final = re.compile(r"^events\.rank(\d+)\.(\d{5,})\.jsonl(\.gz)?$")


#: A workspace's trail directory (``WORKSPACE/logs``).
LOGS: Final = "logs"
#: Every file of every rank's trail, active or closed.
ANY_FILE: Final = "events.rank*.jsonl*"


def active_name(rank: int | str) -> str:
    """The file rank ``rank`` writes (``"*"``: a pattern that matches every rank's)."""
    return f"events.rank{rank}.jsonl"


def rank_of(path: Path) -> int | None:
    """The rank a trail file (active or segment) belongs to, None for other files."""
    match = _ACTIVE.match(path.name) or _SEGMENT.match(path.name)
    return int(match.group(1)) if match else None


def is_segment(path: Path) -> bool:
    return _SEGMENT.match(path.name) is not None


def closed_segments(active: Path) -> list[Path]:
    """The closed segments before ``active``, oldest first; a segment present both plain and
    compressed (killed while compressing) is read from its plain, complete file."""
    rank = rank_of(active)
    if rank is None or not active.parent.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in active.parent.glob(f"events.rank{rank}.*.jsonl*"):
        match = _SEGMENT.match(path.name)
        if match is None or int(match.group(1)) != rank:
            continue
        number = int(match.group(2))
        if number not in found or not match.group(3):  # plain wins over .gz
            found[number] = path
    return [found[n] for n in sorted(found)]


def files_of(active: Path) -> list[Path]:
    """Every file of a rank's trail in the order it was written: closed segments, then ``active``."""
    files = closed_segments(active)
    if active.exists():
        files.append(active)
    return files


def next_number(active: Path) -> int:
    segments = closed_segments(active)
    if not segments:
        return 1
    match = _SEGMENT.match(segments[-1].name)
    return int(match.group(2)) + 1 if match else 1


def segment_path(active: Path, number: int) -> Path:
    rank = rank_of(active)
    return active.with_name(f"events.rank{rank}.{number:05d}.jsonl")


def open_segment(path: Path) -> IO[bytes]:
    """A trail file for reading, decompressed if it is a ``.gz`` segment."""
    if path.name.endswith(COMPRESSED):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def compress(plain: Path) -> Path:
    """Compress a closed segment next to itself, then delete the plain file; returns the ``.gz``."""
    target = plain.with_name(plain.name + COMPRESSED)
    partial = plain.with_name(plain.name + COMPRESSED + ".tmp")
    with open(plain, "rb") as source, gzip.open(partial, "wb", compresslevel=GZIP_LEVEL) as sink:
        shutil.copyfileobj(source, sink, 1 << 20)
    os.replace(partial, target)
    plain.unlink()
    return target


def unfinished(active: Path) -> list[Path]:
    """Closed segments left plain by a process killed before it compressed them (their stale
    ``.tmp`` files are removed)."""
    rank = rank_of(active)
    if rank is None or not active.parent.is_dir():
        return []
    for stale in active.parent.glob(f"events.rank{rank}.*.jsonl{COMPRESSED}.tmp"):
        stale.unlink(missing_ok=True)
    return [p for p in closed_segments(active) if not p.name.endswith(COMPRESSED)]


def last_event(path: Path) -> dict[str, Any] | None:
    """The last complete event of an existing trail (one with a run id and an attempt), or None:
    the previous attempt's end (the stall watchdog compares a stall with it).

    Reads only the tail of the file being written, or of the last closed segment when that file
    is empty (a process killed right after rotating): trails of week-long runs are large. A
    truncated last line (a killed writer) is skipped.
    """
    for file in reversed(files_of(path)):
        found = _last_event_in(file)
        if found is not None:
            return found
    return None


def _last_event_in(path: Path) -> dict[str, Any] | None:
    with open_segment(path) as f:
        if path.name.endswith(COMPRESSED):
            tail = f.read()[-(1 << 16) :].splitlines()  # a closed segment: bounded by SEGMENT_BYTES
        else:
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
            return event
    return None


class FileSink:
    """structlog's final "logger": writes rendered lines; flushes all but debug events. Under the
    log's lock, so that no line follows the stall watchdog's last ones (``write_out_before_exit``)."""

    def __init__(self, file: IO[bytes], lock: threading.Lock, flushed: Callable[[], None]) -> None:
        self._lock = lock
        self._flushed = flushed  # called with the lock held
        self.info = self.warning = self.error = self.critical = self._write_flush
        self.retarget(file)

    def retarget(self, file: IO[bytes]) -> None:
        self._file = file

    def debug(self, line: bytes) -> None:
        with self._lock:
            self._file.write(line)

    def _write_flush(self, line: bytes) -> None:
        with self._lock:
            self._file.write(line)
            self._file.flush()
            self._flushed()


class NullSink:
    """Without a workspace: events reach the console only."""

    def _drop(self, line: bytes) -> None:
        return None

    debug = info = warning = error = critical = _drop
