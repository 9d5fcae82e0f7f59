"""The room of a run's checkpoints, taken in RESTORE (``CheckpointStore.reserve``), before the first step.

Why: a disk without room for the run's checkpoints should fail at the start, not at a save an hour
later; and the first saves should write over allocated blocks and, through the page cache, cached
pages, as later ones do (they write over recycled files: ``trainfsm.checkpoint.recycling``).

What is taken: ``copies`` files of each of about the sizes given (file stem -> bytes, such as a
checkpoint's about to be saved; the newest checkpoint's file where larger: ``wanted``), less the
room the disk holds for them already (``room_held``): the files kept for recycling and those of the
unkept checkpoints that pruning will recycle (the one a restart just loaded among them; not one a
pointer other than ``latest`` names, nor a file with another name). Files too small to matter
(``recycling.large``) are left out. So a restart takes the room the run took between its saves
(with ``keep_previous=0``: the newest checkpoint and one checkpoint's files kept for the next save),
and a disk without it fails now: OSError ENOSPC.

How (``take``): where the disk holds none of that room (a fresh start), the files are written
(``_write``), so that the first saves write over allocated blocks and cached pages
(``DurableWriter(keep_pages=True)``); ``stop`` is asked before each ``BUFFER_BYTES``, and where it
says so the reservation ends there (a file cut short is deleted): RESTORE's passes an exit signal
pending, so that a preempted run does not wait for seconds of writes it will not use. Otherwise (a
restart) the files are allocated without a byte written (``trainfsm.checkpoint.disk.allocate``): the
first save after it writes over unwritten blocks, at about a new file's speed, rather than every
restart writing checkpoints of filler.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from trainfsm.checkpoint import recycling
from trainfsm.checkpoint.disk import allocate
from trainfsm.checkpoint.io import BUFFER_BYTES, DurableWriter, Staging, filler
from trainfsm.checkpoint.writemode import WriteMode


class Reserved(NamedTuple):
    """What ``CheckpointStore.reserve`` took: the bytes it wrote, whether it took all it was asked,
    and the bytes it allocated without writing them."""

    bytes: int
    complete: bool
    allocated: int = 0


def wanted(sizes: dict[str, int], newest: Path | None, copies: int) -> list[int]:
    """The large files to take room for, largest first: ``copies`` of each of ``sizes`` (file stem
    -> bytes), each at least the size of its file in the ``newest`` checkpoint."""
    sizes = {stem: max(n, _file_bytes(newest / f"{stem}.pt") if newest else 0) for stem, n in sizes.items()}
    return sorted((n for n in sizes.values() if recycling.large(n)), reverse=True) * copies


def room_held(folders: Iterable[Path]) -> int:
    """The bytes of the large files in ``folders`` (the files kept for recycling, the checkpoints
    pruning will recycle) that the run's saves will write over: each with no other name."""
    held = 0
    for folder in folders:
        with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
            for entry in entries:
                stat = entry.stat()
                if entry.name.endswith(".pt") and recycling.large(stat.st_size) and stat.st_nlink == 1:
                    held += stat.st_size
    return held


def take(
    recycler: recycling.Recycler,
    wanted: list[int],
    held: int,
    mode: WriteMode,
    io: ThreadPoolExecutor,
    staging: Staging,
    stop: Callable[[], bool] | None,
) -> Reserved:
    """Take the room of the ``wanted`` files that the ``held`` bytes do not cover, in ``recycler``'s
    files: allocated on a restart (``held`` > 0), written on a fresh start."""
    restart = held > 0  # a run's room is on disk already: allocate the rest, write nothing
    missing = []
    for nbytes in wanted:  # the largest first, each from what is held while it lasts
        if held >= nbytes:
            held -= nbytes
        else:
            missing.append(nbytes)
    if not missing:
        return Reserved(0, True)
    recycler.bin.mkdir(parents=True, exist_ok=True)
    if restart:
        return _allocate(recycler, missing)
    return _write(recycler, missing, mode, io, staging, stop)


def _allocate(recycler: recycling.Recycler, missing: list[int]) -> Reserved:
    bin_ = recycler.bin
    names = [f"{uuid.uuid4().hex[:12]}.pt" for _ in missing]
    try:
        allocated = allocate(bin_, zip(names, missing, strict=True))
    finally:
        recycler.reserved.update(st.st_ino for st in map(_stat, (bin_ / n for n in names)) if st)
    return Reserved(0, True, allocated)


def _write(
    recycler: recycling.Recycler,
    missing: list[int],
    mode: WriteMode,
    io: ThreadPoolExecutor,
    staging: Staging,
    stop: Callable[[], bool] | None,
) -> Reserved:
    data = filler()
    written = 0
    for nbytes in missing:
        path = recycler.bin / f"{uuid.uuid4().hex[:12]}.pt"
        direct = mode.for_file(nbytes).direct
        writer = DurableWriter(path, io, staging, direct=direct, keep_pages=True)
        complete = False
        try:
            for _ in range(-(-nbytes // BUFFER_BYTES)):
                if stop is not None and stop():
                    break
                writer.write(data)
            else:
                writer.finish()
                complete = True
        finally:
            if not complete:  # stopped, or failed: no file cut short stays behind
                writer.abort()
                path.unlink(missing_ok=True)
        if not complete:
            return Reserved(written, False)
        recycler.cached.wrote(writer)
        recycler.reserved.add(path.stat().st_ino)
        written += writer.bytes
    return Reserved(written, True)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _file_bytes(path: Path) -> int:
    """The size of ``path`` (0 where it is missing)."""
    stat = _stat(path)
    return 0 if stat is None else stat.st_size
