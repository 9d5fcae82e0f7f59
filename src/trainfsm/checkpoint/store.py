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

The store shares its root with whatever else is there: a step directory without our manifest is
``foreign``, never replaced or deleted (``trainfsm.checkpoint.directories``).

This module is the order in which things must reach the disk; each of them is another's business
(all ``trainfsm.checkpoint.``): a save's files (``parts``), how their bytes get there fast
(``io``) and which way is faster on this disk (``writemode``), what a complete checkpoint holds and
how a reader checks it (``manifest``), the pointers (``pointers``), pruned files written over by
later saves (``recycling``) and the room a run takes in RESTORE (``reservation``).
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainfsm.checkpoint import reservation
from trainfsm.checkpoint.directories import TRAINFSM, TRAINLOOP, Checkpoint, ours, step_directories
from trainfsm.checkpoint.directories import foreign_in_the_way as foreign_in_the_way  # restore.py's path
from trainfsm.checkpoint.io import (
    IO_THREADS,
    Staging,
    check_checksum,
    digest,
    fsync_dir,
    rehearse,
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
from trainfsm.checkpoint.parts import Writing, add_written, write_parts
from trainfsm.checkpoint.pointers import LATEST, Pointers
from trainfsm.checkpoint.recycling import RECYCLE, Recycler, pt_bytes
from trainfsm.checkpoint.recycling import RECYCLED_BYTES as RECYCLED_BYTES  # its home before; tests import it
from trainfsm.checkpoint.replace import TMP_PREFIX, complete_interrupted, put_in_place
from trainfsm.checkpoint.reservation import Reserved
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
        self._recycler = Recycler(root)  # pruned checkpoints' files, for the next saves to write over
        self._pointers = Pointers(root)  # latest, best, ... and those that wait for a save
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
            self._recycler.clear()

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
        """Take the room of ``copies`` files of each of about ``sizes`` (file stem -> bytes) for the
        next saves to write over, less the room the disk holds for them already; OSError ENOSPC
        where the disk has not got it. Written on a fresh start (``stop``, asked before each
        ``BUFFER_BYTES``, ends it early), allocated on a restart. Why and how:
        ``trainfsm.checkpoint.reservation``. Returns the bytes written and allocated, and whether
        all were.

        ``CheckpointingHook`` calls it in RESTORE with the sizes it knows then (the model's state
        and the optimizer's, estimated where its state appears at its first step) and one copy per
        checkpoint the run holds at once: ``keep_previous + 2`` (with ``keep_previous=0``, the
        newest and the one being saved, which the files of the one pruned before it become).
        """
        self.prepare()
        assert self._io is not None and self._staging is not None
        newest = next((c.path for c in reversed(self.checkpoints()) if c.ours), None)
        wanted = reservation.wanted(sizes, newest, copies)
        with self._saving:
            held = reservation.room_held([self._recycler.bin, *self._to_recycle()])
            return reservation.take(self._recycler, wanted, held, self._mode, self._io, self._staging, stop)

    def _to_recycle(self) -> list[Path]:
        """The checkpoints whose large files the run's saves will write over once pruned: our
        unkept ones, not one a pointer other than ``latest`` names, nor one a rollback abandoned or
        is about to (past the step the run starts from, ``resumed_from``)."""
        named = {name for pointer, name in self.pointers().items() if pointer != LATEST}
        found = [c for c in self.checkpoints() if c.ours and not c.kept and c.path.name not in named]
        dropped = self.abandoned(found)
        start = self._resumed_step
        return [c.path for c in found if c.path not in dropped and (start is None or c.step <= start)]

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
        """The save's steps, in the order the module's docstring gives: the files, the other ranks'
        files checked, the manifest last, then the rename and the pointers."""
        name = f"{step}{KEEP_SUFFIX}" if keep else str(step)
        self._refuse_foreign(step, keep)
        self.prepare()
        assert self._io is not None and self._staging is not None
        self.written_with = self._mode.choice
        writing = Writing(self._mode, self._recycler, self._io, self._staging, self._drops, self.checksum)
        mine = write_parts(tmp, parts, keep, writing)  # this process's files (trainfsm.checkpoint.parts)
        if mine.largest_with is not None:
            self.written_with = mine.largest_with
        files = mine.entries
        total = mine.bytes + add_written(tmp, written or {}, files)
        sharded_world = world_size if written is not None else None
        manifest_bytes, checksum = self._write_manifest(tmp, step, keep, files, sharded_world)
        self._publish(tmp, name, step, mine.reused)
        self.wrote_directly = mine.direct
        return Checkpoint(step, self.root / name, keep), total + len(manifest_bytes), checksum

    def _refuse_foreign(self, step: int, keep: bool) -> None:
        """Both copies of ``step`` (kept and not) are ours, or missing: a save never replaces what
        trainfsm did not write. The one this save writes is named first."""
        names = (f"{step}{KEEP_SUFFIX}", str(step))
        for existing in (self.root / name for name in (names if keep else names[::-1])):
            if (existing.exists() or existing.is_symlink()) and not ours(existing):
                raise CheckpointError(foreign_in_the_way(existing, step))

    def _write_manifest(
        self, tmp: Path, step: int, keep: bool, files: dict[str, Any], sharded_world: int | None
    ) -> tuple[bytes, str]:
        """The manifest, last: it marks the set complete. With the save's place in the store's
        history (``trainfsm.checkpoint.lineage``). Its bytes and checksum."""
        if self._sequence is None:  # once: the store's root has one writer
            self._sequence = self._manifests.highest(c.path for c in self.checkpoints() if c.ours)
            start = self._resumed_step if self._resumed_step is not None else step - 1
            self._started = (start, self._sequence)
        self._sequence += 1
        manifest_bytes = encode_manifest(step, keep, files, self.checksum, sharded_world, self._sequence, self._started)
        return manifest_bytes, write_durable(tmp / MANIFEST, manifest_bytes, self.checksum)

    def _publish(self, tmp: Path, name: str, step: int, reused: bool) -> None:
        """The complete ``tmp`` under its step's ``name``, durably; then ``latest`` and the pointers
        that wait for this save (before the caller prunes: their old targets stay protected until now)."""
        fsync_dir(tmp)
        if reused:
            # A file moved out of it: until this directory is synced too, a crash may undo that move,
            # leaving the new checkpoint without the file once the previous one is pruned.
            fsync_dir(self._recycler.bin)
        put_in_place(self.root, tmp, name)  # over our copy of the step, if saved again
        self._pointers.point(LATEST, name)
        self._pointers.move_due(step, name)

    def resumed_from(self, step: int) -> None:
        """The step the run saving here started from: the loaded checkpoint's, 0 for a fresh start.
        Its saves record it, and the checkpoints written before past it are from then on abandoned
        (``trainfsm.checkpoint.lineage``). Before its first save; without it, that save's step less
        one stands for it."""
        self._resumed_step = step

    def point(self, pointer: str, name: str) -> None:
        """Make ``pointer`` (``latest``, ``best``, ...) name checkpoint directory ``name``, atomically:
        a new link renamed over the old one, so a reader sees the old target or the new one."""
        self._pointers.point(pointer, name)

    def point_when_saved(self, pointer: str, step: int) -> None:
        """Move ``pointer`` to the first checkpoint saved at ``step`` or later, as part of that save:
        right after ``latest`` moves and before anything is pruned, on the thread that writes it.
        Register before the save starts (``trainfsm.checkpoint.pointers`` says why)."""
        self._pointers.when_saved(pointer, step)

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
        return step_directories(self.root)

    def foreign(self) -> list[Checkpoint]:
        """Step directories trainfsm did not write (trainloop's, or unknown): never replaced, never pruned."""
        return [c for c in self.checkpoints() if not c.ours]

    def latest_name(self) -> str | None:
        return self._pointers.target(LATEST)

    def target(self, pointer: str) -> str | None:
        """The checkpoint name ``pointer`` holds (it may name a directory that no longer exists)."""
        return self._pointers.target(pointer)

    def pointers(self) -> dict[str, str]:
        """Every pointer under the root (``latest``, ``best``, ...) and the name it holds."""
        return self._pointers.all()

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

        A pruned checkpoint's large files are recycled rather than deleted: gone from the store at
        once, kept for the next saves to write over, where nothing else sees them
        (``trainfsm.checkpoint.recycling``, which says why).
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
                # The files kept add up to one checkpoint's size: the newest one's, or this one's where larger.
                room = max(pt_bytes(complete[-1].path), pt_bytes(checkpoint.path))
                self._recycler.recycle(checkpoint.path, room=room)
                removed.append(checkpoint)
        return removed
