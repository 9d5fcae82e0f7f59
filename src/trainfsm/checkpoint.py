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
   survives a power cut.
4. Only then does ``latest`` move (a new link renamed over the old one), with any pointer that
   waits for this save (``point_when_saved``), and only then are old checkpoints pruned, so there
   is always a complete newest checkpoint on disk and a pointer never names a deleted one.

Loading checks the manifest (format, sizes, checksums) before ``torch.load(weights_only=True)``
touches a byte, so neither a truncated file nor a pickle that would run code is ever unpickled.

Checksums: ``xxh3_128`` by default (the ``xxhash`` package, ~10x sha256's speed on one core), or
``sha256`` (``checksum=``). A checksum stored beside the data guards against torn writes, bit rot
and truncation, not against someone who can rewrite the manifest as well, so a cryptographic hash
buys nothing by default. The manifest (format 4) names its algorithm and a load verifies with
whichever one it names; manifests of formats 1-3 (sha256) still load and verify.

A sharded checkpoint (``CheckpointingHook(sharded=...)``, manifest format 3) is made the same way:
every rank writes its shards into the one temporary directory rank 0 made (``begin``), describes
its files (``describe_file``), and rank 0 lists them all in the manifest (``save(..., into=...,
written=...)``), so it is complete only when every rank's part is durable.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import pickle
import platform
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, cast

import torch

MANIFEST: Final = "manifest.json"
LATEST: Final = "latest"
KEEP_SUFFIX: Final = "_keep"
TMP_PREFIX: Final = ".tmp-"
#: 4: the manifest names its "checksum" algorithm, each file lists one sum per CHUNK_BYTES ("chunks"),
#: a sharded one adds "sharded", "world_size" and each shard's writer ("rank"). Still read, all sha256:
#: 3 (format 2, sharded), 2 (a sha256 per chunk, "sha256_chunks"), 1 (one sha256 per file).
FORMAT: Final = 4
READS: Final = (1, 2, 3, 4)
#: The checksums a store writes and reads: the manifest's "checksum" names one of them.
CHECKSUMS: Final = ("xxh3_128", "sha256")
CHUNK_BYTES: Final = 4 << 20  # small enough that hashing starts early and the last chunk is hashed soon
# Staging buffers: the disk writes some while torch fills the next. One chunk each: 4 MiB writes kept
# the disk here busier than 8 or 16 MiB ones (200 MB: ~0.104 s against ~0.113 s). Two writes in
# flight (IO_THREADS) and six buffers, so that two hashes and two writes can run while torch fills
# the next two, were ~5% faster again than one write and four buffers.
BUFFER_BYTES: Final = CHUNK_BYTES
BUFFERS: Final = 6
IO_THREADS: Final = 2
ALIGN: Final = 4096  # O_DIRECT: buffer addresses, file offsets and lengths are multiples of this
HASH_NICE: Final = 10  # how much lower than their creator the hashing threads run (see _hash_pool)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: Path
    kept: bool


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes, checksum: str = "xxh3_128") -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return _hex(checksum, data)


def digest(checksum: str) -> Callable[[], Any]:
    """A new hash object of ``checksum`` (``update``, ``hexdigest``)."""
    if checksum == "sha256":
        return hashlib.sha256
    if checksum == "xxh3_128":
        import xxhash  # a dependency; imported where used, like every heavier import here

        return cast(Callable[[], Any], xxhash.xxh3_128)
    raise CheckpointError(f"unknown checksum {checksum!r} (this trainfsm knows {', '.join(CHECKSUMS)})")


def _hex(checksum: str, data: Any) -> str:
    hasher = digest(checksum)()
    hasher.update(data)
    return str(hasher.hexdigest())


def check_checksum(owner: str, checksum: Any) -> str:
    if checksum not in CHECKSUMS:
        raise ValueError(
            f"{owner} checksum must be one of {', '.join(repr(c) for c in CHECKSUMS)} (xxh3_128: fast, the "
            f"default; sha256: cryptographic); got {checksum!r}."
        )
    return str(checksum)


def _matches(file: Path, expected: dict[str, Any], pool: ThreadPoolExecutor, checksum: str) -> bool:
    """Whether ``file`` has the sums its manifest entry lists (per chunk; format 1: one sha256 whole)."""
    sums = expected.get("chunks", expected.get("sha256_chunks"))
    if sums is not None:
        chunk = expected.get("chunk_bytes")
        if not isinstance(chunk, int) or chunk <= 0:
            return False
        return bool(_file_sums(file, chunk, pool, checksum) == sums)
    whole = digest("sha256")()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            whole.update(block)
    return bool(whole.hexdigest() == expected.get("sha256"))


def _lower_priority() -> None:
    """Run this thread ``HASH_NICE`` levels below the one that made it (Linux only: elsewhere a
    thread's priority is not its own, and setting it would slow the whole process)."""
    if not sys.platform.startswith("linux"):
        return
    me = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + HASH_NICE))


def _hash_pool(purpose: str) -> ThreadPoolExecutor:
    """Two threads for sha256 work (hashlib releases the GIL), below the thread that writes.

    Hashing takes more CPU than anything else in a save (~0.14 core-seconds per 200 MB), so on a
    small machine it competes with the thread that serializes the file into the staging buffers.
    That thread is what the disk waits for: given way to, it fills the next buffer early and the
    disk stays busy while the hashers catch up (a 200 MB save here went from ~0.135 s to ~0.115 s
    with this alone). During an asynchronous save the same priority keeps the hashers behind the
    training thread.
    """
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"trainfsm-{purpose}", initializer=_lower_priority)


def parse_step(name: str) -> tuple[int, bool] | None:
    """(step, kept) for a checkpoint directory name, None for anything else."""
    kept = name.endswith(KEEP_SUFFIX)
    digits = name[: -len(KEEP_SUFFIX)] if kept else name
    return (int(digits), kept) if digits.isdigit() else None


class _Staging:
    """The page-aligned buffers a store copies every file it writes through (``BUFFERS`` x
    ``BUFFER_BYTES``), touched once when made and reused by every save: no save waits for the
    kernel to find fresh pages for it, neither here nor in the page cache."""

    def __init__(self) -> None:
        self.views = [memoryview(mmap.mmap(-1, BUFFER_BYTES)) for _ in range(BUFFERS)]  # a view keeps its map
        zeros = bytes(BUFFER_BYTES)
        for view in self.views:
            view[:] = zeros


def _open_for_writing(path: Path, direct: bool) -> tuple[int, bool]:
    """A new file's descriptor, and whether it writes past the page cache (``O_DIRECT``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        with contextlib.suppress(OSError):  # tmpfs and some network or FUSE file systems refuse it
            return os.open(path, flags | o_direct, 0o644), True
    return os.open(path, flags, 0o644), False


class _DurableWriter:
    """The file ``torch.save`` writes into: copies it through the store's staging buffers, each
    of which is hashed and written in the background while torch fills the next.

    Why not let torch write into the page cache and fsync at the end, as ``torch.save`` + fsync
    does? That costs a copy into freshly allocated page-cache pages, then a writeback that only
    starts when asked, then a sha256 pass; on a small machine those compete for the same cores.
    Here:

    - the files are opened with ``O_DIRECT`` where the file system allows it, so the disk reads
      each full buffer straight from our (page-aligned, reused) memory (two writes in flight) and
      is busy from the first 4 MiB on; a checkpoint also never pushes the training data out of the page cache.
      Where ``O_DIRECT`` is refused (at ``open`` or at a write), the same buffers are written
      through the page cache instead, and ``finish`` fsyncs them;
    - each buffer is one ``CHUNK_BYTES`` chunk of the file, hashed by one of the store's two hashing
      threads (hashlib releases the GIL); the manifest lists one sha256 per chunk;
    - ``write`` copies the bytes before it returns, so torch may free or reuse what it passed
      (device tensors reach it through temporary host buffers);
    - a buffer is reused only when its write and its hashes are done; an error in either surfaces
      at the next use of that buffer or in ``finish``, never later.

    The last buffer is padded to ``ALIGN`` bytes for ``O_DIRECT`` and the file cut back to its size.
    """

    def __init__(
        self,
        path: Path,
        io: ThreadPoolExecutor,
        hashers: ThreadPoolExecutor,
        staging: _Staging,
        *,
        direct: bool,
        checksum: str = "xxh3_128",
    ) -> None:
        self._path = path
        self._checksum = checksum
        self._fd, self._direct = _open_for_writing(path, direct)
        self._direct_fd = self._fd if self._direct else -1
        self._switching = threading.Lock()
        self._io = io
        self._hashers = hashers
        self._buffers = staging.views
        self._busy: list[list[Future[Any]]] = [[] for _ in self._buffers]  # what still uses each buffer
        self._current = 0
        self._filled = 0  # bytes in the current buffer
        self._offset = 0  # where the current buffer starts in the file
        self._sums: list[Future[str]] = []
        self._padded = False
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        done = 0
        while done < size:
            buffer = self._buffers[self._current]
            take = min(BUFFER_BYTES - self._filled, size - done)
            buffer[self._filled : self._filled + take] = view[done : done + take]
            self._filled += take
            done += take
            if self._filled == BUFFER_BYTES:
                self._send()
                self._settle(self._current)
        self.bytes += size
        return size

    def _send(self) -> None:
        """Hash and write the current buffer in the background, then move on to the next one."""
        index, length = self._current, self._filled
        buffer = self._buffers[index]
        chunk_sum = self._hashers.submit(_hex, self._checksum, buffer[:length])  # a buffer is one chunk
        self._sums.append(chunk_sum)
        tasks: list[Future[Any]] = [chunk_sum]
        end = -(-length // ALIGN) * ALIGN if self._direct else length
        if end > length:
            buffer[length:end] = bytes(end - length)
            self._padded = True
        tasks.append(self._io.submit(self._write_at, buffer[:end], self._offset))
        self._busy[index] = tasks
        self._offset += length
        self._current = (index + 1) % len(self._buffers)
        self._filled = 0

    def _settle(self, index: int) -> None:
        tasks, self._busy[index] = self._busy[index], []
        for task in tasks:
            task.result()

    def _write_at(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            fd = self._fd
            try:
                written = os.pwrite(fd, view, offset)
            except OSError as error:
                if error.errno != errno.EINVAL or fd != self._direct_fd:
                    raise
                self._through_page_cache(fd)
                continue
            view = view[written:]
            offset += written

    def _through_page_cache(self, refused: int) -> None:
        """``O_DIRECT`` was refused at a write: go on without it (what was written stays). The
        refused descriptor stays open until ``finish``: the other I/O thread may be using it."""
        with self._switching:
            if self._fd == refused:
                self._fd = os.open(self._path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
                self._direct = False

    def _close(self) -> None:
        os.close(self._fd)
        if self._direct_fd not in (-1, self._fd):
            os.close(self._direct_fd)

    @property
    def direct(self) -> bool:
        """Whether the file is (still) written past the page cache."""
        return self._direct

    def flush(self) -> None:
        return None

    def finish(self) -> dict[str, Any]:
        """Write the rest, wait for every write and hash, fsync, close; returns the manifest entry."""
        if self._filled or not self._sums:  # an empty file still has one chunk: the sum of no bytes
            self._send()
        for index in range(len(self._buffers)):
            self._settle(index)
        if self._padded:
            os.ftruncate(self._fd, self.bytes)
        os.fsync(self._fd)
        self._close()
        sums = [task.result() for task in self._sums]
        return {"bytes": self.bytes, "chunk_bytes": CHUNK_BYTES, "chunks": sums}

    def abort(self) -> None:
        for tasks in self._busy:
            for task in tasks:
                task.exception()
        self._close()


def _serialize(obj: Any, writer: _DurableWriter) -> None:
    """``torch.save(obj, writer)``, without torch's per-record crc32 where this torch allows it.

    The crc32 is half of a plain ``torch.save``'s time here (0.05 of 0.10 s per 200 MB) and adds
    nothing: the manifest's sha256 sums cover every byte, and a load checks them before torch reads
    the file (torch reads files without crc32 as well). torch's switch for it,
    ``set_crc32_options``, is process-wide, so it is not flipped: the writer torch.save would make
    is made here with ``compute_crc32=False``. Should a torch release change those internals, this
    falls back to a plain ``torch.save`` (slower, same file format); ``tests/test_checkpointing.py``
    checks that the torch it runs with takes the fast path.
    """
    try:
        zip_writer = torch._C.PyTorchFileWriter(
            cast(IO[bytes], writer), False, torch.serialization._get_storage_alignment()
        )
        save: Callable[..., None] = torch.serialization._save
    except (AttributeError, TypeError):  # pragma: no cover - another torch's internals
        torch.save(obj, writer)  # type: ignore[arg-type]
        return
    try:
        save(obj, zip_writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # Finalize before the writer is collected: torch's destructor would finalize by writing
        # through ``writer`` again, and a second failure there aborts the process.
        with contextlib.suppress(Exception):
            zip_writer.write_end_of_file()
        raise
    zip_writer.write_end_of_file()


def _file_sums(path: Path, chunk: int, pool: ThreadPoolExecutor, checksum: str) -> list[str]:
    """The ``checksum`` of each ``chunk`` bytes of ``path``, two chunks at a time (reads and hashing
    release the GIL)."""
    size = path.stat().st_size
    count = max(1, -(-size // chunk))
    new = digest(checksum)

    def one(index: int) -> str:
        hasher = new()
        with open(path, "rb", buffering=0) as f:
            f.seek(index * chunk)
            left = min(chunk, size - index * chunk)
            buffer = bytearray(min(left, 4 << 20))
            view = memoryview(buffer)
            while left > 0:
                got = f.readinto(view[: min(left, len(buffer))])
                if not got:
                    break
                hasher.update(view[:got])
                left -= got
        return str(hasher.hexdigest())

    return list(pool.map(one, range(count)))


def describe_file(path: Path, checksum: str = "xxh3_128") -> dict[str, Any]:
    """The manifest entry of a file already written and synced (by another writer, such as DCP)."""
    with _hash_pool("ckpt-hash") as pool:
        sums = _file_sums(path, CHUNK_BYTES, pool, checksum)
    return {"bytes": path.stat().st_size, "chunk_bytes": CHUNK_BYTES, "chunks": sums}


class CheckpointStore:
    """Save, list, verify, load and prune the checkpoints under ``root``.

    ``direct_io=False`` writes through the page cache even where ``O_DIRECT`` works (see
    ``_DurableWriter``); a store holds ``BUFFERS`` x ``BUFFER_BYTES`` (24 MiB) of staging memory
    from its first save until ``close``.
    """

    def __init__(self, root: Path, *, direct_io: bool = True, checksum: str = "xxh3_128") -> None:
        if not isinstance(direct_io, bool):
            raise TypeError(f"CheckpointStore direct_io must be True or False; got {direct_io!r}.")
        self.root = root
        self.direct_io = direct_io
        self.checksum = check_checksum("CheckpointStore", checksum)
        self._io: ThreadPoolExecutor | None = None
        self._hashers: ThreadPoolExecutor | None = None
        self._staging: _Staging | None = None
        self._saving = threading.Lock()  # one save at a time: they share the staging buffers
        #: Whether every file of the last save was written past the page cache (O_DIRECT); False
        #: when ``direct_io=False`` or the file system refused it (the ``checkpoint_saved`` event
        #: says which). The shards of a sharded save are written by DCP, through the page cache.
        self.wrote_directly = False
        # Pointers to move with a later save (point_when_saved): pointer -> first step it may name.
        # Registered on the training thread, applied on the one that saves (an async writer).
        self._due: dict[str, int] = {}
        self._due_lock = threading.Lock()

    def close(self) -> None:
        for pool in (self._io, self._hashers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._io = self._hashers = None
        self._staging = None

    # ------------------------------------------------------------------ saving
    def prepare(self) -> float:
        """Make the writer's threads and staging buffers now (a no-op when they exist); seconds taken.

        A first save would otherwise pay for them inside the step path (the 24 MiB of buffers are
        touched page by page); ``CheckpointingHook`` calls this in RESTORE instead.
        """
        started = time.perf_counter()
        if self._io is None or self._hashers is None or self._staging is None:
            self._io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="trainfsm-ckpt-io")
            self._hashers = _hash_pool("ckpt-hash")
            self._staging = _Staging()
            digest(self.checksum)  # imports xxhash
        return time.perf_counter() - started

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
                return self._save_into(tmp, step, parts, keep, written, world_size)
        except BaseException:
            self.discard(tmp)
            raise

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
        self.prepare()
        assert self._io is not None and self._hashers is not None and self._staging is not None
        files: dict[str, dict[str, Any]] = {}
        total = 0
        direct = True
        for stem, obj in parts.items():
            writer = _DurableWriter(
                tmp / f"{stem}.pt",
                self._io,
                self._hashers,
                self._staging,
                direct=self.direct_io,
                checksum=self.checksum,
            )
            try:
                _serialize(obj, writer)
                files[f"{stem}.pt"] = writer.finish()
            except BaseException:
                writer.abort()
                raise
            total += writer.bytes
            direct = direct and writer.direct
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
            _fsync_dir(folder)  # the other ranks' file names are durable before the manifest names them
        from trainfsm import __version__

        manifest: dict[str, Any] = {
            "format": FORMAT,
            "checksum": self.checksum,
            "step": step,
            "kept": keep,
            "created": time.time(),
            "files": files,
            "versions": {"trainfsm": __version__, "torch": torch.__version__, "python": platform.python_version()},
        }
        if written is not None:
            manifest.update(sharded=True, world_size=world_size)
        manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
        checksum = _write_durable(tmp / MANIFEST, manifest_bytes, self.checksum)  # last: it marks the set complete
        _fsync_dir(tmp)
        target = self.root / name
        other = self.root / (str(step) if keep else f"{step}{KEEP_SUFFIX}")
        for existing in (target, other):  # the same step saved again (a resumed run): replace it
            if existing.exists():
                trash = self.root / f"{TMP_PREFIX}old-{existing.name}-{uuid.uuid4().hex[:8]}"
                existing.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(target)
        _fsync_dir(self.root)
        self.point(LATEST, name)
        with self._due_lock:
            due = [pointer for pointer, first in self._due.items() if first <= step]
            for pointer in due:
                del self._due[pointer]
        for pointer in due:  # before the caller prunes: the old target stays protected until now
            self.point(pointer, name)
        self.wrote_directly = direct
        return Checkpoint(step, target, keep), total + len(manifest_bytes), checksum

    def point(self, pointer: str, name: str) -> None:
        """Make ``pointer`` (``latest``, ``best``, ...) name checkpoint directory ``name``, atomically:
        a new link renamed over the old one, so a reader sees the old target or the new one."""
        _check_pointer(pointer)
        link = self.root / pointer
        tmp = self.root / f"{TMP_PREFIX}{pointer}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.symlink_to(name, target_is_directory=True)
        except OSError:  # filesystems without symlinks: a one-line file instead
            _write_durable(tmp, (name + "\n").encode())
        os.replace(tmp, link)
        _fsync_dir(self.root)

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

    def remove_leftovers(self) -> list[str]:
        """Delete temporary directories of interrupted saves; returns their names.

        A ``.tmp-old-<name>-*`` directory is a complete checkpoint that a re-save of the same step
        moved aside; if the save died before its replacement arrived, it is moved back instead.
        """
        if not self.root.is_dir():
            return []
        removed = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(f"{TMP_PREFIX}old-") and entry.is_dir():
                name = entry.name[len(f"{TMP_PREFIX}old-") :].rsplit("-", 1)[0]
                if not (self.root / name / MANIFEST).is_file() and (entry / MANIFEST).is_file():
                    entry.rename(self.root / name)
                    _fsync_dir(self.root)
                    continue
            if entry.name.startswith(TMP_PREFIX):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry.name)
        return removed

    # ------------------------------------------------------------------ listing
    def checkpoints(self) -> list[Checkpoint]:
        """Every step directory, complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            parsed = parse_step(entry.name)
            if parsed is not None and entry.is_dir() and not entry.is_symlink():
                found.append(Checkpoint(parsed[0], entry, parsed[1]))
        return sorted(found, key=lambda c: (c.step, c.kept))

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
        """Checkpoints to try for ``load="latest"``, newest step first.

        Not ``latest``'s target first: a save that died after its rename but before ``latest`` moved
        leaves a newer complete checkpoint than the one ``latest`` names, and it is the one to use.
        """
        yield from reversed(self.checkpoints())

    # ------------------------------------------------------------------ verifying and loading
    @staticmethod
    def verify(path: Path, share: tuple[int, int] | None = None) -> dict[str, Any]:
        """The manifest of a complete, intact checkpoint; CheckpointError naming what is wrong.

        ``share=(rank, world_size)``: of a sharded checkpoint, check only this rank's share of the
        files (those its ``rank`` wrote, modulo ``world_size``; rank 0 also the files without one),
        so that the ranks verify it together; they must then agree on the outcome. Every file of
        a checkpoint that is not sharded is checked either way.
        """
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {MANIFEST} is missing (an interrupted save?)")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{manifest_path} is not valid JSON ({exc})") from None
        found = manifest.get("format") if isinstance(manifest, dict) else None
        if found not in READS or not isinstance(manifest.get("files"), dict):
            raise CheckpointError(
                f"{manifest_path} has unknown format {found!r} (this trainfsm reads formats "
                f"{', '.join(map(str, READS))})"
            )
        parsed = parse_step(path.name)
        if parsed is not None and manifest.get("step") != parsed[0]:
            raise CheckpointError(
                f"{manifest_path} describes step {manifest.get('step')!r}, not {parsed[0]} (a manifest from "
                f"another checkpoint?)"
            )
        checksum = manifest.get("checksum", "sha256") if found == FORMAT else "sha256"
        if checksum not in CHECKSUMS:
            raise CheckpointError(
                f"{manifest_path} names checksum {checksum!r}; this trainfsm verifies {', '.join(CHECKSUMS)}"
            )
        listed: dict[str, Any] = manifest["files"]
        if share is not None and manifest.get("sharded"):
            rank, world = share
            listed = {n: e for n, e in listed.items() if _owner(e, world) == rank}
        with _hash_pool("ckpt-verify") as pool:
            for name, expected in listed.items():
                file = path / name
                if not file.is_file():
                    raise CheckpointError(f"{file} is missing (listed in {MANIFEST})")
                size = file.stat().st_size
                if size != expected.get("bytes"):
                    raise CheckpointError(
                        f"{file} has {size} bytes, the manifest says {expected.get('bytes')} (truncated?)"
                    )
                if not _matches(file, expected, pool, checksum):
                    raise CheckpointError(f"{file} does not match its {checksum} in {MANIFEST} (corrupted)")
        return manifest  # type: ignore[no-any-return]

    @classmethod
    def load(cls, path: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        """Verify (unless given the ``manifest`` ``verify`` returned), then load every ``.pt`` file
        with ``weights_only=True``: file stem -> object. Of a sharded checkpoint, that is
        ``training_state`` and ``hooks``: its model and optimizer are read with DCP (the hook does)."""
        if manifest is None:
            manifest = cls.verify(path)
        parts = {}
        for name in manifest["files"]:
            if "/" in name or not name.endswith(".pt"):
                continue  # a shard of a sharded checkpoint
            try:
                parts[name.removesuffix(".pt")] = torch.load(path / name, map_location="cpu", weights_only=True)
            except Exception as exc:  # weights_only refuses arbitrary pickles: say so, run nothing
                raise CheckpointError(
                    f"{path / name} could not be loaded safely with weights_only=True ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}); it holds objects other than tensors and "
                    f"plain containers, or is not a torch file"
                ) from None
        return parts

    # ------------------------------------------------------------------ pruning
    def prune(self, keep_previous: int) -> list[Checkpoint]:
        """Delete complete, unkept checkpoints beyond the newest ``keep_previous + 1``; never the
        newest complete one, never a kept one, never one a pointer (``latest``, ``best``) names."""
        complete = [c for c in self.checkpoints() if (c.path / MANIFEST).is_file()]
        if not complete:
            return []
        protected = {c.path for c in complete if c.kept}
        protected.add(complete[-1].path)
        targets = set(self.pointers().values())
        protected.update(c.path for c in complete if c.path.name in targets)
        unkept = [c for c in complete if not c.kept]
        protected.update(c.path for c in unkept[-(keep_previous + 1) :])
        removed = []
        for checkpoint in complete:
            if checkpoint.path not in protected:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
                removed.append(checkpoint)
        return removed


def _owner(entry: dict[str, Any], world: int) -> int:
    """The rank that verifies a file of a sharded checkpoint: the one that wrote it, modulo the
    world size that reads it; rank 0 for files rank 0 wrote alone (training_state.pt, hooks.pt)."""
    rank = entry.get("rank", 0)
    return rank % world if isinstance(rank, int) and rank >= 0 else 0


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


def check_fits(path: Path, current: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse a model state whose keys or shapes differ from the model's, naming them all.
    ``saved`` holds tensors, or (a sharded checkpoint's metadata) their global ``torch.Size``.

    Checked before anything is loaded, so a mismatch changes nothing: torch would otherwise
    report only the first problem it meets, or fail on the optimizer's state first.
    """
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    shapes = sorted(
        f"{key} (checkpoint {tuple(saved_shape)}, model {tuple(model_shape)})"
        for key in set(current) & set(saved)
        if (model_shape := _shape(current[key])) is not None
        and (saved_shape := _shape(saved[key])) is not None
        and model_shape != saved_shape
    )
    problems = [
        f"{label}: {', '.join(items)}"
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", shapes))
        if items
    ]
    if problems:
        raise CheckpointError(
            f"{path} does not fit the model ({'; '.join(problems)}). Resume with the model it was saved "
            f"from, or load it with load=None and copy the weights you want yourself."
        )


def _shape(value: Any) -> torch.Size | None:
    if isinstance(value, torch.Tensor):
        return value.shape  # a DTensor's is the global shape
    return value if isinstance(value, torch.Size) else None
