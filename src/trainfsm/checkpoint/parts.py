"""A save's files: its parts (file stem -> object) written by this process, each its own way,
over a recycled file where there is one, all fsynced after the last (``write_parts``); and, in a
sharded save, the files the other ranks wrote, checked before the manifest lists them (``add_written``).

Why in this order: each file is written whole, then the next; the fsyncs come after the last one,
so that a file's writeback drains while the next is serialized (a small file's pickling, hidden
behind a large one's last writes), and each waits only for what is left of its own. Each file's
seconds, from serializing it to its own fsync, count for its way's rate where it wrote over a file
as running saves do (``WriteMode.rated``, ``after_write``). A file that fails, or a save that fails
after it, leaves no descriptor open: every writer not yet synced is aborted. Where the files go
and in which order the checkpoint becomes complete is ``trainfsm.checkpoint.store``'s business.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfsm.checkpoint.io import DurableWriter, Staging, fsync_dir, serialize
from trainfsm.checkpoint.manifest import CheckpointError
from trainfsm.checkpoint.recycling import Recycler, recyclable
from trainfsm.checkpoint.writemode import Choice, WriteMode


@dataclass(slots=True)
class Written:
    """What ``write_parts`` wrote: each file's manifest entry (name -> entry), their bytes, whether
    every file went past the page cache, whether one was written over a recycled file (its
    directory must be synced too), and the way the largest was written (None: no file)."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    bytes: int = 0
    direct: bool = True
    reused: bool = False
    largest_with: Choice | None = None


@dataclass(frozen=True, slots=True)
class Writing:
    """What writes a store's files: its way of writing, its recycled files, its writer's threads and
    buffers (``CheckpointStore.prepare``), and the checksum each file gets on its way."""

    mode: WriteMode
    recycler: Recycler
    io: ThreadPoolExecutor
    staging: Staging
    drops: ThreadPoolExecutor | None
    checksum: str


def write_parts(tmp: Path, parts: dict[str, Any], keep: bool, writing: Writing) -> Written:
    """Write each of ``parts`` as ``<stem>.pt`` into ``tmp`` (``keep``: a checkpoint never pruned,
    whose pages are not worth keeping cached), then fsync them in order."""
    mode = writing.mode
    written = Written()
    unsynced: list[DurableWriter] = []  # aborted (their descriptors closed) if the save fails
    # Each file's way, its seconds writing, and whether it counts for its way's rate.
    ways: list[tuple[Choice, float, bool]] = []
    try:
        for stem, obj in parts.items():
            choice, expected = mode.for_part(stem, obj)
            started = time.perf_counter()
            path = tmp / f"{stem}.pt"
            overwrite, cached = writing.recycler.reuse(expected, path, choice.direct)
            writer = DurableWriter(
                path,
                writing.io,
                writing.staging,
                direct=choice.direct,
                checksum=writing.checksum,
                drops=writing.drops,
                overwrite=overwrite,
                keep_pages=recyclable(expected, keep),
            )
            unsynced.append(writer)
            written.reused = written.reused or overwrite
            serialize(obj, writer)
            written.entries[f"{stem}.pt"] = writer.complete()
            ways.append((choice, time.perf_counter() - started, mode.rated(overwrite, writer.direct, cached)))
            mode.part_written(stem, writer.bytes)
        _sync(unsynced, ways, writing, written)
    except BaseException:
        for writer in unsynced:
            writer.abort()
        raise
    return written


def _sync(
    unsynced: list[DurableWriter], ways: list[tuple[Choice, float, bool]], writing: Writing, written: Written
) -> None:
    """Fsync the files written, in order, each one's seconds counted for its way (its writing and its
    own fsync); ``unsynced`` is emptied as they become durable."""
    largest = 0
    for choice, seconds, rated in ways:
        writer = unsynced[0]
        syncing = time.perf_counter()
        writer.sync()
        unsynced.pop(0)
        seconds += time.perf_counter() - syncing  # its writing and its own fsync
        writing.mode.after_write(writer.direct, writer.bytes, seconds, rated=rated)
        writing.recycler.cached.wrote(writer)
        if writer.bytes >= largest:
            largest, written.largest_with = writer.bytes, choice
        written.bytes += writer.bytes
        written.direct = written.direct and writer.direct


def add_written(tmp: Path, written: dict[str, dict[str, Any]], files: dict[str, Any]) -> int:
    """The other ranks' files of a sharded save: each checked to be in ``tmp`` with its size and
    added to ``files``, their names made durable before the manifest names them; their bytes."""
    total = 0
    for relative, entry in written.items():
        file = tmp / relative
        size = file.stat().st_size if file.is_file() else None
        if size is None or size != entry.get("bytes"):
            raise CheckpointError(
                f"rank {entry.get('rank')} wrote {relative} ({entry.get('bytes')} bytes), but this process "
                f"finds {'no such file' if size is None else f'{size} bytes'} in {tmp}: sharded checkpoints "
                f"need a filesystem that every rank shares (the same path on every node)"
            )
        files[relative] = entry
        total += size
    for folder in sorted({(tmp / relative).parent for relative in written}):
        fsync_dir(folder)  # the other ranks' file names are durable before the manifest names them
    return total
