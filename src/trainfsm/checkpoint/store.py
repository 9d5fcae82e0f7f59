"""An atomic, verified checkpoint store: one directory per step, a manifest, a ``latest`` pointer.

Layout under the store's root::

    1000/            model.pt, training_state.pt, [hooks.pt], manifest.json
    5000_keep/       a kept checkpoint (keep_interval / keep_steps): never pruned
    latest -> 5000_keep   a relative symlink, or a one-line file where links are not allowed
    best -> 1000     any other pointer (``point``): pruning never deletes a pointer's target

Why each step of a save is there (a crash may happen between any two of them):

1. Files are written into ``.tmp-<step>-<nonce>/`` beside the target and fsynced: a reader never
   sees a half-written file under a step's name.
2. ``manifest.json`` is written last, so a directory without a manifest is never complete.
3. The directory is fsynced, renamed into place, and the parent fsynced: after that, the rename
   survives a power cut. A step saved again keeps a complete copy throughout, and RESTORE puts a
   complete temporary directory in place rather than delete it (``trainfsm.checkpoint.replace``).
4. Only then does ``latest`` move (a new link renamed over the old one), with any pointer that
   waits for this save (``point_when_saved``), and only then are old checkpoints pruned, so there
   is always a complete newest checkpoint on disk and a pointer never names a deleted one.

Loading checks the manifest before a byte is unpickled (``verify`` / ``load``, from
``trainfsm.checkpoint.manifest``, which holds the manifest's format and its checks); a checkpoint that fails
the check is skipped for the next older one (``candidates``), and one a rollback abandoned is never
tried (``trainfsm.checkpoint.lineage``).

A sharded checkpoint (``CheckpointingHook(sharded=...)``) is made the same way: every rank writes
its shards into the one temporary directory rank 0 made (``begin``), describes its files
(``describe_file``), and rank 0 lists them all in the manifest (``save(..., into=...,
written=...)``), so it is complete only when every rank's part is durable.

The store shares its root with whatever else is there: a step directory without our manifest
(``trainloop``'s checkpoints, which load through ``trainfsm.checkpoint.trainloop``, or anything else) is
``foreign``, and neither a save nor pruning ever replaces or deletes it.

What a complete checkpoint holds and how a reader checks it is ``trainfsm.checkpoint.manifest``'s
business; how the bytes get to the disk fast (staging buffers, ``O_DIRECT``, checksums on the way)
is ``trainfsm.checkpoint.io``'s, and which way is faster on this disk ``trainfsm.checkpoint.writemode``'s;
this module is the order in which they must get there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

from trainfsm.checkpoint.disk import allocate, unshared
from trainfsm.checkpoint.io import (
    BUFFER_BYTES,
    IO_THREADS,
    DurableWriter,
    Staging,
    check_checksum,
    digest,
    filler,
    fsync_dir,
    rehearse,
    serialize,
    tensor_bytes,
    write_durable,
)
from trainfsm.checkpoint.lineage import Manifests, abandoned
from trainfsm.checkpoint.manifest import (
    FORMAT,
    KEEP_SUFFIX,
    MANIFEST,
    READS,
    CheckpointError,
    encode_manifest,
    parse_step,
)
from trainfsm.checkpoint.manifest import load as load_checkpoint
from trainfsm.checkpoint.manifest import verify as verify_checkpoint
from trainfsm.checkpoint.replace import complete_interrupted, put_in_place
from trainfsm.checkpoint.trainloop import is_trainloop
from trainfsm.checkpoint.writemode import Choice, WriteMode

__all__ = [
    "FORMAT",
    "KEEP_SUFFIX",
    "LATEST",
    "MANIFEST",
    "READS",
    "TMP_PREFIX",
    "TRAINFSM",
    "TRAINLOOP",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "parse_step",
]

LATEST: Final = "latest"
TMP_PREFIX: Final = ".tmp-"
#: Files smaller than this are neither recycled nor reserved (``CheckpointStore.prune``, ``reserve``):
#: finding their room costs little, and deleting them too.
RECYCLED_BYTES: Final = 8 << 20
#: Where pruned checkpoints' files wait to be overwritten by the next save (``CheckpointStore.prune``):
#: a temporary name, so that RESTORE removes what a crash left there.
RECYCLE: Final = f"{TMP_PREFIX}recycle"


#: Who wrote a step directory (``Checkpoint.written_by``): trainfsm (it has our manifest), trainloop
#: (its files, no manifest: ``trainfsm.checkpoint.trainloop``), or None for anything else under that name.
TRAINFSM: Final = "trainfsm"
TRAINLOOP: Final = "trainloop"


class Reserved(NamedTuple):
    """What ``CheckpointStore.reserve`` took: the bytes it wrote, whether it took all it was asked,
    and the bytes it allocated without writing them."""

    bytes: int
    complete: bool
    allocated: int = 0


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: Path
    kept: bool
    written_by: str | None = TRAINFSM

    @property
    def ours(self) -> bool:
        """Whether trainfsm wrote it: the only directories a save may replace and pruning may delete."""
        return self.written_by == TRAINFSM


class CheckpointStore:
    """Save, list, verify, load and prune the checkpoints under ``root``.

    Files go through the page cache with each 4 MiB's writeback started at once, or past it with
    ``O_DIRECT``: ``direct_io="auto"`` (the default) measures both on the store's file system in
    ``prepare`` and uses the faster for each file's size (``trainfsm.checkpoint.writemode``);
    ``True``/``False`` forces one.
    A store holds ``BUFFERS`` x ``BUFFER_BYTES`` of staging memory from ``prepare`` (or its first
    save) until ``close``.
    """

    def __init__(self, root: Path, *, direct_io: bool | str = "auto", checksum: str = "xxh3_128") -> None:
        self.root = root
        self._mode = WriteMode("CheckpointStore", direct_io)
        self.direct_io = self._mode.setting
        self.checksum = check_checksum("CheckpointStore", checksum)
        self._io: ThreadPoolExecutor | None = None
        self._drops: ThreadPoolExecutor | None = None  # drops written files' clean pages, off the save's path
        self._staging: Staging | None = None
        self._saving = threading.Lock()  # one save at a time: they share the staging buffers
        #: Whether every file of the last save was written past the page cache (O_DIRECT), and the
        #: choice it was written with (the ``checkpoint_saved`` event says both). The shards of a
        #: sharded save are written by DCP, through the page cache.
        self.wrote_directly = False
        self.written_with: Choice | None = None  # the way the last save's largest file was written, and why
        self._file_bytes: dict[str, int] = {}  # each file's size at the last save: how its next one is written
        self._cached = _CachedFiles()  # which recycled files a page-cache write finds in the cache
        # Inodes of the files ``reserve`` made in this process and no save has used yet: no one else
        # has seen them, so a save writes over them even where ``unshared`` cannot tell (NFS).
        self._reserved: set[int] = set()
        # Pointers to move with a later save (point_when_saved): pointer -> first step it may name.
        # Registered on the training thread, applied on the one that saves (an async writer).
        self._due: dict[str, int] = {}
        self._due_lock = threading.Lock()
        # Each checkpoint's place in the store's history, and this run's (trainfsm.checkpoint.lineage).
        self._manifests = Manifests()
        self._sequence: int | None = None  # the last save's
        self._resumed_step: int | None = None  # the step the run started from (resumed_from)
        self._started: tuple[int, int] | None = None  # (that step, the highest sequence on disk then)

    def close(self) -> None:
        """Release the writer's threads and buffers, and delete the files kept for recycling (the
        run is over: the disk holds its checkpoints and nothing else)."""
        self._mode.close()
        for pool in (self._io, self._drops):
            if pool is not None:
                pool.shutdown(wait=True)
        self._io = self._drops = None
        self._staging = None
        with self._saving:
            shutil.rmtree(self.root / RECYCLE, ignore_errors=True)
            self._cached = _CachedFiles()
            self._reserved.clear()

    # ------------------------------------------------------------------ saving
    def prepare(self) -> float:
        """Do now what a first save would otherwise do once, inside the step path; seconds taken (a
        no-op once done). ``CheckpointingHook`` calls it in RESTORE.

        That is: the writer's I/O thread (started) and staging buffers (24 MiB, touched page by
        page), the checksum's and torch's serializer's imports (``rehearse``), and the way of writing
        (``mode``: measured on this file system, or forced). The root is made for the measurement
        and removed again if it stays empty.
        """
        started = time.perf_counter()
        if self._io is None or self._staging is None:
            self._io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="trainfsm-ckpt-io")
            self._drops = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainfsm-ckpt-drop")
            for pool in (self._io, self._drops):
                pool.submit(lambda: None).result()  # a pool starts its thread at its first task
            self._staging = Staging()
            digest(self.checksum)  # imports xxhash
            rehearse()
        if self._mode.choice is None:
            made = not self.root.is_dir()
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                self._mode.choose(self.root, self._io, self._staging)
            finally:
                if made:
                    with contextlib.suppress(OSError):
                        self.root.rmdir()  # nothing saved yet: no directory to show for it
        return time.perf_counter() - started

    def reserve(self, sizes: dict[str, int], copies: int = 1, stop: Callable[[], bool] | None = None) -> Reserved:
        """Take the room of ``copies`` files of each of about ``sizes`` (file stem -> bytes, such as
        a checkpoint's about to be saved; the newest checkpoint's file where larger), for the next
        saves to write over (``prune``), less the room the disk holds for them already: the files
        kept for recycling and those of the unkept checkpoints that pruning will recycle (the one a
        restart just loaded among them; not one a pointer other than ``latest`` names, nor a file
        with another name). Files too small to matter are left out. So a restart takes the room
        the run took between its saves (with ``keep_previous=0``: the newest checkpoint and one
        checkpoint's files kept for the next save), and a disk without it fails now: OSError ENOSPC.

        Where the disk holds none of that room (a fresh start), the files are written, so that the
        first saves write over allocated blocks and, through the page cache, cached pages, as later
        ones do (``DurableWriter(keep_pages=True)``); ``stop`` is asked before each
        ``BUFFER_BYTES``, and where it says so the reservation ends there (a file cut short is
        deleted). RESTORE's passes an exit signal pending, so that a preempted run does not wait for
        seconds of writes it will not use. Otherwise (a restart) the files are allocated without a
        byte written (``trainfsm.checkpoint.disk.allocate``): the first save after it writes over
        unwritten blocks, at about a new file's speed, rather than every restart writing
        checkpoints of filler. Returns the bytes written and allocated, and whether all were.

        ``CheckpointingHook`` calls it in RESTORE with the sizes it knows then (the model's state
        and the optimizer's, estimated where its state appears at its first step) and one copy per
        checkpoint the run holds at once: ``keep_previous + 2`` (with ``keep_previous=0``, the
        newest and the one being saved, which the files of the one pruned before it become).
        """
        self.prepare()
        assert self._io is not None and self._staging is not None
        newest = next((c.path for c in reversed(self.checkpoints()) if c.ours), None)
        sizes = {stem: max(n, _file_bytes(newest / f"{stem}.pt") if newest else 0) for stem, n in sizes.items()}
        wanted = sorted((n for n in sizes.values() if n >= RECYCLED_BYTES), reverse=True) * copies
        bin_ = self.root / RECYCLE
        with self._saving:
            held = self._room_held()
            restart = held > 0
            missing = []
            for nbytes in wanted:  # the largest first, each from what is held while it lasts
                if held >= nbytes:
                    held -= nbytes
                else:
                    missing.append(nbytes)
            if not missing:
                return Reserved(0, True)
            bin_.mkdir(parents=True, exist_ok=True)
            if restart:
                names = [f"{uuid.uuid4().hex[:12]}.pt" for _ in missing]
                try:
                    allocated = allocate(bin_, zip(names, missing, strict=True))
                finally:
                    self._reserved.update(st.st_ino for st in map(_stat, (bin_ / n for n in names)) if st)
                return Reserved(0, True, allocated)
            data = filler()
            written = 0
            for nbytes in missing:
                path = bin_ / f"{uuid.uuid4().hex[:12]}.pt"
                direct = self._mode.for_file(nbytes).direct
                writer = DurableWriter(path, self._io, self._staging, direct=direct, keep_pages=True)
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
                self._cached.wrote(writer)
                self._reserved.add(path.stat().st_ino)
                written += writer.bytes
            return Reserved(written, True)

    def _room_held(self) -> int:
        """The bytes of the large files on disk that the run's saves will write over: the files
        kept for recycling, and those of our unkept checkpoints that pruning will recycle (not one
        a pointer other than ``latest`` names, nor one a rollback abandoned or is about to: past
        the step the run starts from, ``resumed_from``), each with no other name (``prune``)."""
        named = {name for pointer, name in self.pointers().items() if pointer != LATEST}
        found = [c for c in self.checkpoints() if c.ours and not c.kept and c.path.name not in named]
        dropped = self.abandoned(found)
        start = self._resumed_step
        folders = [c.path for c in found if c.path not in dropped and (start is None or c.step <= start)]
        held = 0
        for folder in [self.root / RECYCLE, *folders]:
            with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
                for entry in entries:
                    stat = entry.stat()
                    if entry.name.endswith(".pt") and stat.st_size >= RECYCLED_BYTES and stat.st_nlink == 1:
                        held += stat.st_size
        return held

    @property
    def mode(self) -> Choice | None:
        """How the last file was written, and why; before the first save, how a file of a size not
        saved yet would be (None before ``prepare``). ``written_with``: the last save's largest file's."""
        return self._mode.choice

    def begin(self, step: int) -> Path:
        """A new temporary directory for checkpoint ``step``, for writers other than ``save`` (the
        ranks of a sharded save); pass it to ``save(into=...)``, or to ``discard`` on failure."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{step}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    @staticmethod
    def discard(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing partial stays behind; older ones are untouched

    def save(
        self,
        step: int,
        parts: dict[str, Any],
        *,
        keep: bool,
        into: Path | None = None,
        written: dict[str, dict[str, Any]] | None = None,
        world_size: int | None = None,
    ) -> tuple[Checkpoint, int, str]:
        """Write ``parts`` (file stem -> object) as checkpoint ``step``; returns it, bytes, manifest hash.

        A sharded save passes the directory from ``begin`` (``into``), the entries of the files the
        ranks already wrote there (``written``: name relative to the checkpoint -> ``describe_file``
        entry with the writer's ``rank``) and the ``world_size`` that wrote them: the manifest lists
        them beside ``parts`` (format 3), after checking that each is there with its size.
        """
        tmp = into if into is not None else self.begin(step)
        try:
            with self._saving:
                saved = self._save_into(tmp, step, parts, keep, written, world_size)
        except BaseException:
            self.discard(tmp)
            raise
        assert self._io is not None and self._staging is not None
        self._mode.recheck_if_due(self.root, self._io, self._staging, self._saving)  # off the save's time
        return saved

    def _save_into(
        self,
        tmp: Path,
        step: int,
        parts: dict[str, Any],
        keep: bool,
        written: dict[str, dict[str, Any]] | None,
        world_size: int | None,
    ) -> tuple[Checkpoint, int, str]:
        name = f"{step}{KEEP_SUFFIX}" if keep else str(step)
        target = self.root / name
        other = self.root / (str(step) if keep else f"{step}{KEEP_SUFFIX}")
        for existing in (target, other):
            if (existing.exists() or existing.is_symlink()) and not _ours(existing):
                raise CheckpointError(foreign_in_the_way(existing, step))
        self.prepare()
        assert self._io is not None and self._staging is not None
        files: dict[str, dict[str, Any]] = {}
        total = largest = 0
        direct = True
        reused = False
        self.written_with = self._mode.choice
        # Each file is written whole, then the next; the fsyncs come after the last one, so that a
        # file's writeback drains while the next is serialized (a small file's pickling, hidden
        # behind a large one's last writes), and each waits only for what is left of its own.
        unsynced: list[DurableWriter] = []  # aborted (their descriptors closed) if the save fails
        # Each file's way, its seconds writing, and whether it counts for its way's rate.
        ways: list[tuple[Choice, float, bool]] = []
        try:
            for stem, obj in parts.items():
                # Each file its own way, by its size: its size last time, or its tensors' bytes.
                expected = self._file_bytes.get(stem)
                if expected is None:
                    expected = tensor_bytes(obj)
                choice = self._mode.for_file(expected)
                writing = time.perf_counter()
                path = tmp / f"{stem}.pt"
                overwrite, cached = self._reuse(expected, path, choice.direct)
                writer = DurableWriter(
                    path,
                    self._io,
                    self._staging,
                    direct=choice.direct,
                    checksum=self.checksum,
                    drops=self._drops,
                    overwrite=overwrite,
                    keep_pages=_recyclable(expected, keep),
                )
                unsynced.append(writer)
                reused = reused or overwrite
                serialize(obj, writer)
                files[f"{stem}.pt"] = writer.complete()
                # It counts for its way where it wrote over a file as saves do once running: with
                # O_DIRECT over its blocks, through the page cache over its cached pages too. A new
                # file's blocks and fresh pages are a one-off, not the way's rate.
                rated = overwrite and (writer.direct or cached)
                ways.append((choice, time.perf_counter() - writing, rated))
                self._file_bytes[stem] = writer.bytes
            for choice, seconds, rated in ways:
                writer = unsynced[0]
                syncing = time.perf_counter()
                writer.sync()
                unsynced.pop(0)
                seconds += time.perf_counter() - syncing  # its writing and its own fsync
                self._mode.after_write(writer.direct, writer.bytes, seconds, rated=rated)
                self._cached.wrote(writer)
                if writer.bytes >= largest:
                    largest, self.written_with = writer.bytes, choice
                total += writer.bytes
                direct = direct and writer.direct
        except BaseException:
            for writer in unsynced:
                writer.abort()
            raise
        for relative, entry in (written or {}).items():
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
        for folder in sorted({(tmp / relative).parent for relative in written or {}}):
            fsync_dir(folder)  # the other ranks' file names are durable before the manifest names them
        if self._sequence is None:  # once: the store's root has one writer
            self._sequence = self._manifests.highest(c.path for c in self.checkpoints() if c.ours)
            start = self._resumed_step if self._resumed_step is not None else step - 1
            self._started = (start, self._sequence)
        self._sequence += 1
        sharded_world = world_size if written is not None else None
        manifest_bytes = encode_manifest(step, keep, files, self.checksum, sharded_world, self._sequence, self._started)
        checksum = write_durable(tmp / MANIFEST, manifest_bytes, self.checksum)  # last: it marks the set complete
        fsync_dir(tmp)
        if reused:
            # A file moved out of it: until this directory is synced too, a crash may undo that move,
            # leaving the new checkpoint without the file once the previous one is pruned.
            fsync_dir(self.root / RECYCLE)
        put_in_place(self.root, tmp, name)  # over our copy of the step, if saved again
        self.point(LATEST, name)
        with self._due_lock:
            due = [pointer for pointer, first in self._due.items() if first <= step]
            for pointer in due:
                del self._due[pointer]
        for pointer in due:  # before the caller prunes: the old target stays protected until now
            self.point(pointer, name)
        self.wrote_directly = direct
        return Checkpoint(step, target, keep), total + len(manifest_bytes), checksum

    def resumed_from(self, step: int) -> None:
        """The step the run saving here started from: the loaded checkpoint's, 0 for a fresh start.
        Its saves record it, and the checkpoints written before past it are from then on abandoned
        (``trainfsm.checkpoint.lineage``). Before its first save; without it, that save's step less
        one stands for it."""
        self._resumed_step = step

    def point(self, pointer: str, name: str) -> None:
        """Make ``pointer`` (``latest``, ``best``, ...) name checkpoint directory ``name``, atomically:
        a new link renamed over the old one, so a reader sees the old target or the new one."""
        _check_pointer(pointer)
        link = self.root / pointer
        tmp = self.root / f"{TMP_PREFIX}{pointer}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.symlink_to(name, target_is_directory=True)
        except OSError:  # filesystems without symlinks: a one-line file instead
            write_durable(tmp, (name + "\n").encode())
        os.replace(tmp, link)
        fsync_dir(self.root)

    def point_when_saved(self, pointer: str, step: int) -> None:
        """Move ``pointer`` to the first checkpoint saved at ``step`` or later, as part of that save:
        right after ``latest`` moves and before anything is pruned, on the thread that writes it.

        Register before the save starts (a later registration for the same pointer replaces an
        earlier one). Pointing after ``save`` returns would race an asynchronous writer's prune,
        which may delete the new target before the pointer protects it.
        """
        _check_pointer(pointer)
        with self._due_lock:
            self._due[pointer] = step

    def complete_interrupted(self) -> list[str]:
        """Put the complete checkpoints that killed saves left in temporary directories in place
        (the new copy of a re-saved step over the old); the names put in place
        (``trainfsm.checkpoint.replace``)."""
        return complete_interrupted(self.root)

    def remove_leftovers(self) -> list[str]:
        """Delete what interrupted saves and prunes left (``.tmp-*``), once ``complete_interrupted``
        put every complete checkpoint among it in place; returns the names deleted."""
        if not self.root.is_dir():
            return []
        self.complete_interrupted()
        removed = []
        for entry in sorted(self.root.iterdir()):
            if entry.name == RECYCLE and entry.is_dir() and not entry.is_symlink():
                continue  # the store's own files, room RESTORE counts (``reserve``); re-checked before a write
            if entry.name.startswith(TMP_PREFIX):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry.name)
        return removed

    # ------------------------------------------------------------------ listing
    def checkpoints(self) -> list[Checkpoint]:
        """Every step directory, whoever wrote it (``written_by``), oldest first."""
        try:
            entries = list(self.root.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            # None yet; or, on a rank other than 0, the empty root that rank 0 made to measure the
            # disk in RESTORE (prepare) and removed again between a check and this listing.
            return []
        found = []
        for entry in entries:
            parsed = parse_step(entry.name)
            if parsed is not None and entry.is_dir() and not entry.is_symlink():
                found.append(Checkpoint(parsed[0], entry, parsed[1], _writer(entry)))
        return sorted(found, key=lambda c: (c.step, c.kept))

    def foreign(self) -> list[Checkpoint]:
        """Step directories trainfsm did not write (trainloop's, or unknown): never replaced, never pruned."""
        return [c for c in self.checkpoints() if not c.ours]

    def latest_name(self) -> str | None:
        return self.target(LATEST)

    def target(self, pointer: str) -> str | None:
        """The checkpoint name ``pointer`` holds (it may name a directory that no longer exists)."""
        return _read_pointer(self.root / pointer)

    def pointers(self) -> dict[str, str]:
        """Every pointer under the root (``latest``, ``best``, ...) and the name it holds."""
        if not self.root.is_dir():
            return {}
        found = {}
        for entry in self.root.iterdir():
            if entry.name.startswith(".") or parse_step(entry.name) is not None:
                continue
            name = _read_pointer(entry)
            if name is not None:
                found[entry.name] = name
        return found

    def candidates(self) -> Iterator[Checkpoint]:
        """Checkpoints to try for ``load="latest"``, newest step first: trainfsm's and trainloop's
        (a directory nobody known wrote is not tried; ``foreign`` lists it), but none a rollback
        abandoned (``trainfsm.checkpoint.lineage``).

        Not ``latest``'s target first: a save that died after its rename but before ``latest`` moved
        leaves a newer complete checkpoint than the one ``latest`` names, written after it, and it is
        the one to use. A newer one written before it belongs to a timeline a run resumed from an
        older checkpoint left behind, and is not.
        """
        found = [c for c in self.checkpoints() if c.written_by is not None]
        dropped = self.abandoned(found)
        yield from (c for c in reversed(found) if c.path not in dropped)

    def abandoned(self, checkpoints: list[Checkpoint] | None = None) -> set[Path]:
        """The paths of the checkpoints (of ``checkpoints``, or all) that a rollback abandoned: written
        before a run that resumed from an earlier step started (``trainfsm.checkpoint.lineage``)."""
        found = self.checkpoints() if checkpoints is None else checkpoints
        return abandoned(((c.step, c.path) for c in found if c.ours), self._manifests)

    # ------------------------------------------------------------------ verifying and loading
    @staticmethod
    def verify(path: Path, share: tuple[int, int] | None = None) -> dict[str, Any]:
        """The manifest of a complete, intact checkpoint; CheckpointError naming what is wrong
        (``share=(rank, world_size)``: a rank's share of a sharded one; see ``trainfsm.checkpoint.manifest.verify``)."""
        return verify_checkpoint(path, share)

    @staticmethod
    def load(path: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        """Verify (unless given the ``manifest`` ``verify`` returned), then load every ``.pt`` file with
        ``weights_only=True``: file stem -> object (see ``trainfsm.checkpoint.manifest.load``)."""
        return load_checkpoint(path, manifest)

    # ------------------------------------------------------------------ pruning
    def prune(self, keep_previous: int) -> list[Checkpoint]:
        """Delete complete, unkept checkpoints beyond the newest ``keep_previous + 1`` of the run's
        timeline; never the newest complete one on it, never a kept one, never one a pointer
        (``latest``, ``best``) names, never one a rollback abandoned (``abandoned``: kept on disk,
        never loaded as ``latest``, counted in no ``keep_previous``), never a directory trainfsm did
        not write (``foreign``).

        A pruned checkpoint's large files (``RECYCLED_BYTES`` or more) are recycled rather than
        deleted: its directory is renamed out of the way (gone from the store at once, as if
        deleted) and its files move into ``RECYCLE``, where the next save writes over them
        (``_reuse``), the files kept adding up to one checkpoint's size at most (the newest one's,
        or the pruned one's where larger). Measured here (ext4 with online discard on a virtual
        disk), 200 MB: a new file took 0.110 s with ``O_DIRECT`` and one written over 0.068 s
        (medians of eight; through the page cache 0.088 against 0.054), and deleting one took
        0.038-0.052 s, which every save after the first paid before. Between saves the disk holds
        the files kept besides the checkpoints (one more checkpoint's worth at most: a save needs
        that room anyway); ``close`` deletes them.

        Only a file nothing else sees is written over (``trainfsm.checkpoint.disk.unshared``, asked
        here and again just before the write): one with another name (a hard link: ``cp -al``,
        ``ln`` to pin a step) or open in any process is deleted instead, which only drops the
        store's name for it, so the link or the reader keeps step N's bytes; on a file system where
        that cannot be known (NFS and other network ones), nothing is written over. The rule costs
        a save nothing measurable (~20 µs a file); preallocating new files instead (``fallocate``)
        cost each 200 MB save 18-39 ms more through the page cache and 6-31 ms with ``O_DIRECT``
        here (medians of two runs), and a deletion beside it.

        Written through the page cache, such files keep their pages there (``_recyclable``): a
        write over cached pages needs no fresh memory, which on this virtual machine is what a
        page-cache write after a pause waited for (``DurableWriter``). So the page cache holds the
        unkept checkpoints' large files and the recycled ones (``keep_previous + 2`` checkpoints'
        worth), clean and evictable as any cached file; ``direct_io=True`` keeps checkpoints out of
        it altogether.
        """
        with self._saving:  # the recycled files are the saves'
            return self._prune(keep_previous)

    def _prune(self, keep_previous: int) -> list[Checkpoint]:
        complete = [c for c in self.checkpoints() if c.ours]
        if not complete:
            return []
        # Abandoned ones are never pruned (a rollback is the user's choice; the run it rolled back
        # is trained work only they may delete) and count for no keep_previous: the window is the
        # timeline's, or a rollback's saves would prune its own previous checkpoints.
        dropped = self.abandoned(complete)
        timeline = [c for c in complete if c.path not in dropped]  # never empty: the newest-written is on it
        protected = {c.path for c in complete if c.kept} | dropped
        protected.add(timeline[-1].path)
        targets = set(self.pointers().values())
        protected.update(c.path for c in complete if c.path.name in targets)
        unkept = [c for c in timeline if not c.kept]
        protected.update(c.path for c in unkept[-(keep_previous + 1) :])
        removed = []
        for checkpoint in complete:
            if checkpoint.path not in protected:
                self._recycle(checkpoint.path, room=max(_pt_bytes(complete[-1].path), _pt_bytes(checkpoint.path)))
                removed.append(checkpoint)
        return removed

    def _recycle(self, path: Path, room: int) -> None:
        """Remove checkpoint ``path``, keeping its files for the next saves while the files kept
        stay within ``room`` bytes; the rest is deleted."""
        aside = self.root / f"{TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            path.rename(aside)  # no longer a checkpoint, in one step: a crash leaves a leftover
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            bin_ = self.root / RECYCLE
            kept = _pt_bytes(bin_)
            for file in sorted(aside.glob("*.pt"), key=lambda f: f.stat().st_size, reverse=True):
                size = file.stat().st_size
                # Linked or open elsewhere: those bytes are someone's step N, never written over.
                if size < RECYCLED_BYTES or kept + size > room or not unshared(file):
                    self._cached.forget(file)  # deleted below: its inode may be a new file's next
                    continue
                bin_.mkdir(exist_ok=True)
                file.rename(bin_ / f"{uuid.uuid4().hex[:12]}.pt")
                kept += size
        finally:
            shutil.rmtree(aside, ignore_errors=True)

    def _reuse(self, nbytes: int, path: Path, direct: bool) -> tuple[bool, bool]:
        """Move a recycled file to ``path`` for a file of about ``nbytes`` to be written over it
        the ``direct`` way: of the files that hold ``nbytes`` (else of all: the largest), through
        the page cache one whose pages are cached (``_cached``), with ``O_DIRECT`` one whose are
        not (its write would drop them), then the smallest. Whether there was one (never for a small
        file: it would cut a large one down), and whether its pages were cached."""
        if nbytes < RECYCLED_BYTES:
            return False, False
        bin_ = self.root / RECYCLE
        try:
            files = [(entry.stat(), entry.path) for entry in os.scandir(bin_) if entry.name.endswith(".pt")]
        except FileNotFoundError:
            return False, False
        while files:
            large_enough = [f for f in files if f[0].st_size >= nbytes]
            candidates = large_enough or [max(files, key=lambda f: f[0].st_size)]
            stat, chosen = min(candidates, key=lambda f: (self._cached.holds(f[0]) == direct, f[0].st_size))
            os.rename(chosen, path)  # durable with both directories' fsyncs (``_save_into``)
            # Asked again now: linked or opened since its prune (a copy of the root, say).
            if stat.st_ino in self._reserved or unshared(path):
                self._reserved.discard(stat.st_ino)
                return True, self._cached.holds(stat)
            self._cached.forget(path)
            path.unlink()  # theirs now: the store only lets go of its name
            files.remove((stat, chosen))
        return False, False


class _CachedFiles:
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


def _recyclable(nbytes: int, keep: bool) -> bool:
    """Whether a file of about ``nbytes`` in a checkpoint (``keep``: never pruned) will be written
    over by a later save, so that its pages are worth keeping in the page cache until then
    (``DurableWriter(keep_pages=...)``)."""
    return nbytes >= RECYCLED_BYTES and not keep


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _file_bytes(path: Path) -> int:
    """The size of ``path`` (0 where it is missing)."""
    stat = _stat(path)
    return 0 if stat is None else stat.st_size


def _pt_bytes(directory: Path) -> int:
    """The bytes of the ``.pt`` files in ``directory`` (0 where it is missing)."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.name.endswith(".pt"))
    except FileNotFoundError:
        return 0


def foreign_in_the_way(path: Path, step: int) -> str:
    """Why a save at ``step`` cannot use ``path``, and what to do."""
    writer = "trainloop" if is_trainloop(path) else "something other than trainfsm"
    return (
        f"{path} was written by {writer} (it has no {MANIFEST}), and this run saves step {step} there; "
        f"trainfsm never replaces or deletes a directory it did not write. Move it out of {path.parent} "
        f"(or delete it if you no longer need it), or give CheckpointingHook another path=."
    )


def _ours(path: Path) -> bool:
    """A directory with our manifest (trainfsm writes it before the directory gets a step's name);
    a symlink never is: trainfsm names checkpoints with real directories only."""
    return path.is_dir() and not path.is_symlink() and (path / MANIFEST).is_file()


def _writer(path: Path) -> str | None:
    if (path / MANIFEST).is_file():
        return TRAINFSM
    return TRAINLOOP if is_trainloop(path) else None


def _check_pointer(pointer: str) -> None:
    if (
        not isinstance(pointer, str)
        or not pointer
        or pointer.startswith(".")
        or "/" in pointer
        or os.sep in pointer
        or parse_step(pointer) is not None
        or pointer == MANIFEST
    ):
        raise ValueError(
            f"a checkpoint pointer name must be a plain file name that is not a step number, does not "
            f"start with '.' and is not {MANIFEST!r} (e.g. 'latest', 'best'); got {pointer!r}."
        )


def _read_pointer(path: Path) -> str | None:
    """The name a pointer holds: a symlink's target or a one-line file's line; None for anything else."""
    if path.is_symlink():
        return os.readlink(path)
    if path.is_file() and path.stat().st_size <= 4096:  # a pointer is one short line, not a data file
        try:
            return path.read_text().strip() or None
        except UnicodeDecodeError:
            return None
    return None
