"""A pruned checkpoint's large files, kept for the next saves to write over rather than deleted.

Why: writing over a file is faster than writing a new one, and deleting one is not free. Measured
here (ext4 with online discard on a virtual disk), 200 MB: a new file took 0.110 s with
``O_DIRECT`` and one written over 0.068 s (medians of eight; through the page cache 0.088 against
0.054), and deleting one took 0.038-0.052 s, which every save after the first paid before.
Preallocating new files instead (``fallocate``) cost each 200 MB save 18-39 ms more through the page
cache and 6-31 ms with ``O_DIRECT`` here (medians of two runs), and a deletion beside it.

How (``Recycler``): ``CheckpointStore.prune`` hands each checkpoint it removes to ``recycle``, which
renames its directory out of the way (gone from the store at once, as if deleted) and moves its
files of ``RECYCLED_BYTES`` or more into ``RECYCLE``, the files kept adding up to one checkpoint's
size at most; a save takes one for each large file (``reuse``). Between saves the disk holds the
files kept besides the checkpoints (one more checkpoint's worth at most: a save needs that room
anyway); ``clear`` (the store's ``close``) deletes them. ``RECYCLE`` is a temporary name, so that
RESTORE removes what a crash left there.

Only a file nothing else sees is written over (``trainfsm.checkpoint.disk.unshared``, asked at the
prune and again just before the write): one with another name (a hard link: ``cp -al``, ``ln`` to
pin a step) or open in any process is deleted instead, which only drops the store's name for it, so
the link or the reader keeps step N's bytes; on a file system where that cannot be known (NFS and
other network ones), nothing is written over but the files RESTORE reserved in this process
(``reserved``: no one else has seen them). The rule costs a save nothing measurable (~20 µs a file).

Written through the page cache, such files keep their pages there (``recyclable``): a write over
cached pages needs no fresh memory, which on this virtual machine is what a page-cache write after
a pause waited for (``DurableWriter``). So the page cache holds the unkept checkpoints' large files
and the recycled ones (``keep_previous + 2`` checkpoints' worth), clean and evictable as any cached
file; ``direct_io=True`` keeps checkpoints out of it altogether. Which of them are cached is
``CachedFiles``'s to know.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Final

from trainfsm.checkpoint.disk import unshared
from trainfsm.checkpoint.io import DurableWriter
from trainfsm.checkpoint.replace import TMP_PREFIX

#: Files smaller than this are neither recycled nor reserved (``large``): finding their room costs
#: little, and deleting them too.
RECYCLED_BYTES: Final = 8 << 20
#: Where pruned checkpoints' files wait to be overwritten by the next save: a temporary name, so
#: that RESTORE removes what a crash left there.
RECYCLE: Final = f"{TMP_PREFIX}recycle"


def large(nbytes: int) -> bool:
    """Whether a file of ``nbytes`` is worth recycling and reserving (``RECYCLED_BYTES`` or more)."""
    return nbytes >= RECYCLED_BYTES


def recyclable(nbytes: int, keep: bool) -> bool:
    """Whether a file of about ``nbytes`` in a checkpoint (``keep``: never pruned) will be written
    over by a later save, so that its pages are worth keeping in the page cache until then
    (``DurableWriter(keep_pages=...)``)."""
    return large(nbytes) and not keep


class CachedFiles:
    """The store's files whose pages this process left in the page cache: written through it with
    their pages kept (``DurableWriter(keep_pages=True)``), and not written since.

    A page-cache write over cached pages needs no fresh memory; over a file whose pages are gone
    (written with ``O_DIRECT``, which drops them, or by an earlier process) it does, and on this
    virtual machine that costs ~2.6 s per GB after a pause, 7x the write itself (``WriteMode``).
    So such a write says nothing of the page cache's rate, and a page-cache save takes a cached
    file where there is one. A file is known by its inode, valid while its mtime and size are the
    ones its write left (a rename keeps both; anything written to it since changes them). Pages the
    kernel evicts meanwhile are not seen: the belief errs towards rating a slow write, as before.
    """

    def __init__(self) -> None:
        self._files: dict[int, tuple[int, int]] = {}  # inode -> (mtime_ns, size) as its write left it

    def wrote(self, writer: DurableWriter) -> None:
        """After ``writer``'s sync: its file's pages are cached now, or not."""
        self.mark(writer.path, writer.pages_cached)

    def mark(self, path: Path, cached: bool) -> None:
        stat = path.stat()
        if cached:
            self._files[stat.st_ino] = (stat.st_mtime_ns, stat.st_size)
        else:
            self._files.pop(stat.st_ino, None)

    def forget(self, path: Path) -> None:
        """``path`` is about to be deleted."""
        self._files.pop(path.stat().st_ino, None)

    def __len__(self) -> int:
        return len(self._files)

    def holds(self, stat: os.stat_result) -> bool:
        return self._files.get(stat.st_ino) == (stat.st_mtime_ns, stat.st_size)


class Recycler:
    """The files kept under ``root / RECYCLE`` for the saves of the store at ``root`` to write over."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cached = CachedFiles()  # which recycled files a page-cache write finds in the cache
        # Inodes of the files ``reserve`` made in this process and no save has used yet: no one else
        # has seen them, so a save writes over them even where ``unshared`` cannot tell (NFS).
        self.reserved: set[int] = set()

    @property
    def bin(self) -> Path:
        return self.root / RECYCLE

    def clear(self) -> None:
        """Delete the files kept (the run is over: the disk holds its checkpoints and nothing else)."""
        shutil.rmtree(self.bin, ignore_errors=True)
        self.cached = CachedFiles()
        self.reserved.clear()

    def recycle(self, path: Path, room: int) -> None:
        """Remove checkpoint ``path``, keeping its files for the next saves while the files kept
        stay within ``room`` bytes; the rest is deleted."""
        aside = self.root / f"{TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            path.rename(aside)  # no longer a checkpoint, in one step: a crash leaves a leftover
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            bin_ = self.bin
            kept = pt_bytes(bin_)
            for file in sorted(aside.glob("*.pt"), key=lambda f: f.stat().st_size, reverse=True):
                size = file.stat().st_size
                # Linked or open elsewhere: those bytes are someone's step N, never written over.
                if not large(size) or kept + size > room or not unshared(file):
                    self.cached.forget(file)  # deleted below: its inode may be a new file's next
                    continue
                bin_.mkdir(exist_ok=True)
                file.rename(bin_ / f"{uuid.uuid4().hex[:12]}.pt")
                kept += size
        finally:
            shutil.rmtree(aside, ignore_errors=True)

    def reuse(self, nbytes: int, path: Path, direct: bool) -> tuple[bool, bool]:
        """Move a recycled file to ``path`` for a file of about ``nbytes`` to be written over it
        the ``direct`` way: of the files that hold ``nbytes`` (else of all: the largest), through
        the page cache one whose pages are cached (``cached``), with ``O_DIRECT`` one whose are
        not (its write would drop them), then the smallest. Whether there was one (never for a small
        file: it would cut a large one down), and whether its pages were cached."""
        if not large(nbytes):
            return False, False
        try:
            files = [(entry.stat(), entry.path) for entry in os.scandir(self.bin) if entry.name.endswith(".pt")]
        except FileNotFoundError:
            return False, False
        while files:
            large_enough = [f for f in files if f[0].st_size >= nbytes]
            candidates = large_enough or [max(files, key=lambda f: f[0].st_size)]
            stat, chosen = min(candidates, key=lambda f: (self.cached.holds(f[0]) == direct, f[0].st_size))
            os.rename(chosen, path)  # durable with both directories' fsyncs (the store's save)
            # Asked again now: linked or opened since its prune (a copy of the root, say).
            if stat.st_ino in self.reserved or unshared(path):
                self.reserved.discard(stat.st_ino)
                return True, self.cached.holds(stat)
            self.cached.forget(path)
            path.unlink()  # theirs now: the store only lets go of its name
            files.remove((stat, chosen))
        return False, False


def pt_bytes(directory: Path) -> int:
    """The bytes of the ``.pt`` files in ``directory`` (0 where it is missing)."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.name.endswith(".pt"))
    except FileNotFoundError:
        return 0
