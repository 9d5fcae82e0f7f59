"""The I/O under a checkpoint save: durable writes, checksums, and ``torch.save`` into staged buffers.

``trainfsm.checkpoint.store`` says *in which order* things must reach the disk for a save to survive a crash;
this module says *how* bytes get there fast and how they are checked on the way back:

- ``write_durable`` / ``fsync_dir``: the two fsyncs the protocol is made of;
- ``DurableWriter`` + ``serialize``: ``torch.save`` into staging buffers that are written in the
  background while torch fills the next one, each one's writeback started at once, hashed on the way;
- ``file_sums`` / ``describe_file``: the checksums of files on disk (verification, and files other
  writers made, such as DCP's shards).

Checksums: ``xxh3_128`` (the ``xxhash`` package, ~25 GB/s on one core here: 8 ms per 200 MB) or
``sha256`` (~1.1 GB/s). xxh3 is cheap enough to run in order on the thread that fills the
buffers, so a file has one streaming sum and no hashing threads exist.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import pickle
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from io import BytesIO
from pathlib import Path
from typing import IO, Any, Final, cast

import torch

from trainfsm import activity

#: The checksums a store writes and reads: a manifest's "checksum" names one of them.
CHECKSUMS: Final = ("xxh3_128", "sha256")
# Staging buffers, written in order by one I/O thread while torch fills the next ones. Measured with
# the fast checksum against the disk alone (issue 14's closing note; 200 MB | 1 GB saves): what
# matters is how far torch may run ahead of the disk. Six 4 MiB buffers: 0.96-1.08 | 0.96-0.98x the
# disk; three: 1.26-1.47 | 1.26-1.37x (three 8 MiB ones: 0.98-1.00 | 0.98x); four or eight 4 MiB
# buffers bought nothing over six. A second I/O thread (two writes in flight) made no difference
# with six buffers (1.08 | 0.98x against 1.08 | 0.96x with one), so there is one.
BUFFER_BYTES: Final = 4 << 20
BUFFERS: Final = 6
IO_THREADS: Final = 1
ALIGN: Final = 4096  # O_DIRECT: buffer addresses, file offsets and lengths are multiples of this
# Starting a buffer's writeback as soon as it is written: posix_fadvise(DONTNEED) on Linux starts the
# write-out of that range's dirty pages without waiting for it (and drops pages already clean).
_WRITEBACK: Final = getattr(os, "POSIX_FADV_DONTNEED", None) if hasattr(os, "posix_fadvise") else None
READ_BYTES: Final = 4 << 20  # what verification reads at a time
# A write this large (a tensor's storage), through the page cache, skips the staging buffers
# (``DurableWriter._write_from_caller``); smaller ones (zip headers, the pickle) are gathered there.
FROM_CALLER_BYTES: Final = 1 << 20


def filler() -> bytes:
    """``BUFFER_BYTES`` of fixed pseudo-random bytes, for writes whose content does not matter (the
    probe's, RESTORE's reservation): not zeros, which some storage compresses or keeps as holes."""
    import random

    return random.Random(0).randbytes(BUFFER_BYTES)


def digest(checksum: str) -> Callable[[], Any]:
    """A new hash object of ``checksum`` (``update``, ``hexdigest``)."""
    if checksum == "sha256":
        return hashlib.sha256
    if checksum == "xxh3_128":
        import xxhash  # a dependency; imported where used, like every heavier import here

        return cast(Callable[[], Any], xxhash.xxh3_128)
    raise ValueError(f"unknown checksum {checksum!r} (this trainfsm knows {', '.join(CHECKSUMS)})")


def hex_of(checksum: str, data: Any) -> str:
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


def fsync_dir(path: Path) -> None:
    """Make the names in ``path`` (created, renamed, removed) survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes, checksum: str = "xxh3_128") -> str:
    """Write ``data`` to a new file and fsync it (not its directory); returns its checksum."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hex_of(checksum, data)


def file_sums(path: Path, checksum: str, chunk: int | None = None) -> list[str]:
    """The ``checksum`` of ``path``: one sum of the whole file, or (``chunk``, manifests of formats
    2-4) one per ``chunk`` bytes, the last one shorter; an empty file has one sum of no bytes."""
    new = digest(checksum)
    hasher = new()
    sums: list[str] = []
    in_chunk = 0
    buffer = memoryview(bytearray(READ_BYTES))
    with open(path, "rb", buffering=0) as f:
        while True:
            want = READ_BYTES if chunk is None else min(READ_BYTES, chunk - in_chunk)
            got = f.readinto(buffer[:want])
            if not got:
                break
            hasher.update(buffer[:got])
            in_chunk += got
            if in_chunk == chunk:
                sums.append(str(hasher.hexdigest()))
                hasher, in_chunk = new(), 0
    if chunk is None or in_chunk or not sums:
        sums.append(str(hasher.hexdigest()))
    return sums


def describe_file(path: Path, checksum: str = "xxh3_128") -> dict[str, Any]:
    """The manifest entry of a file already written and synced (by another writer, such as DCP)."""
    return {"bytes": path.stat().st_size, "digest": file_sums(path, checksum)[0]}


class Staging:
    """The page-aligned buffers a store copies every file it writes through (``BUFFERS`` x
    ``BUFFER_BYTES``), touched once when made and reused by every save: no save waits for the
    kernel to find fresh pages for it, neither here nor in the page cache."""

    def __init__(self) -> None:
        self.views = [memoryview(mmap.mmap(-1, BUFFER_BYTES)) for _ in range(BUFFERS)]  # a view keeps its map
        zeros = bytes(BUFFER_BYTES)
        for view in self.views:
            view[:] = zeros


def open_for_writing(path: Path, direct: bool, overwrite: bool = False) -> tuple[int, bool]:
    """A descriptor to write ``path`` from its start, and whether it writes past the page cache
    (``O_DIRECT``): a new file, or (``overwrite``) an existing one whose blocks the writer reuses
    and then cuts to its new size (``DurableWriter``)."""
    flags = os.O_WRONLY | (0 if overwrite else os.O_CREAT | os.O_TRUNC) | getattr(os, "O_CLOEXEC", 0)
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        with contextlib.suppress(OSError):  # tmpfs and some network or FUSE file systems refuse it
            return os.open(path, flags | o_direct, 0o644), True
    return os.open(path, flags, 0o644), False


class DurableWriter:
    """The file ``torch.save`` writes into: copies it through the store's staging buffers, each of
    which is written in the background while torch fills the next.

    Why not let torch write into the page cache and fsync at the end, as ``torch.save`` + fsync
    does? Then the kernel starts the writeback only when asked, so the disk idles while torch
    serializes and torch idles while the disk writes. Here:

    - each full buffer is written by the store's I/O thread, one after the other, and its
      writeback is started right away (``posix_fadvise(DONTNEED)`` on the range), so the disk is
      busy from the first 4 MiB on and the final fsync waits only for the last buffers. Measured on
      this machine's disk (ext4 on a virtio disk, issue 14's closing note): 1 GB in 1.6 s this
      way, 3.2 s with ``O_DIRECT``, 3.0 s written then fsynced;
    - after the fsync the file's pages, clean by then, are dropped on ``drops``' thread once
      ``finish`` has returned, so that a checkpoint does not push the training data out of the
      page cache; unless ``keep_pages``: a file that a later save will write over
      (``CheckpointStore.prune`` recycles it) keeps them, so that the next write finds its pages
      in memory. Fresh pages are what a page-cache write waits for on a virtual machine that hands
      free memory back to its host (virtio-balloon free page reporting, as here): 200 MB written
      over a file after 4 s idle took 0.634 s with its pages dropped, 0.079 s with them kept, and
      0.125 s with ``O_DIRECT``; 1 GB 2.64, 0.30 and 0.39 s (medians; issue 35);
    - ``direct=True`` opens the file with ``O_DIRECT`` instead, where the file system allows it
      (the disk reads each buffer straight from our page-aligned memory): for storage where that is
      the faster way; the last buffer is padded to ``ALIGN`` bytes and the file cut back to its
      size. Where ``O_DIRECT`` is refused (at ``open`` or at a write) the writer goes on through
      the page cache;
    - each buffer (or large piece) is hashed, in file order, just after its write is queued, while
      the I/O thread writes it: one streaming sum per file;
    - ``write`` is done with the bytes before it returns, so torch may free or reuse what it
      passed (device tensors reach it through temporary host buffers): it copies them into a
      buffer, or, through the page cache, hands a large piece (a tensor's storage) to the kernel
      straight from torch's memory and waits for it (the kernel's copy is the only one: a 200 MB
      save took 0.077 s this way against 0.091 s staged, medians; 0.65 s against 1.18 s in all
      over 8 saves);
    - a buffer is reused only when its write is done; a write's error surfaces at the next use of
      that buffer or in ``finish``, never later;
    - ``overwrite=True`` writes over an existing file (a pruned checkpoint's, which the store
      recycles) from its start and cuts it to its new size before the fsync: its blocks are
      allocated already, so the file system has none to find and no extents to convert
      (``CheckpointStore.prune``).
    """

    def __init__(
        self,
        path: Path,
        io: ThreadPoolExecutor,
        staging: Staging,
        *,
        direct: bool,
        checksum: str = "xxh3_128",
        drops: ThreadPoolExecutor | None = None,
        overwrite: bool = False,
        keep_pages: bool = False,
    ) -> None:
        self._path = path
        self._fd, self._direct = open_for_writing(path, direct, overwrite)
        self._writeback = _WRITEBACK
        self._io = io
        self._drops = drops or io
        self._buffers = staging.views
        self._writes: list[Future[None] | None] = [None] * len(self._buffers)  # each buffer's write in flight
        self._hash = digest(checksum)()
        self._current = 0
        self._filled = 0  # bytes in the current buffer
        self._offset = 0  # where the current buffer starts in the file
        self._padded = overwrite  # an overwritten file is cut to its new size, as a padded one is
        self.overwrites = overwrite
        self._keep_pages = keep_pages
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if size >= FROM_CALLER_BYTES and not self._direct:
            self._write_from_caller(view)
            self.bytes += size
            return size
        done = 0
        while done < size:
            buffer = self._buffers[self._current]
            take = min(BUFFER_BYTES - self._filled, size - done)
            buffer[self._filled : self._filled + take] = view[done : done + take]
            self._filled += take
            done += take
            if self._filled == BUFFER_BYTES:
                self._send()
                self._wait_for_write(self._current)
        self.bytes += size
        return size

    def _write_from_caller(self, view: memoryview) -> None:
        """Through the page cache, a large piece (a tensor's storage) goes to the kernel straight from
        torch's memory, in ``BUFFER_BYTES`` slices on the I/O thread, each hashed here while it is
        written: the kernel's copy into the page cache is the only copy, where the staging buffers
        would add one of their own (200 MB: ~25 ms here). It returns once every
        slice is written, so torch may reuse the memory as before. ``O_DIRECT`` needs aligned
        memory, so it keeps the staging buffers."""
        if self._filled:
            self._send()  # what is staged goes first: the sum and the file stay in order
            self._wait_for_write(self._current)  # the next buffer is free before anything fills it
        writes = []
        try:
            for start in range(0, view.nbytes, BUFFER_BYTES):
                piece = view[start : start + BUFFER_BYTES]
                writes.append(self._io.submit(self._write_at, piece, self._offset))
                self._offset += piece.nbytes
                self._hash.update(piece)  # while the I/O thread writes it
        finally:
            errors = [write.exception() for write in writes]  # every slice is done with torch's memory
        for error in errors:
            if error is not None:
                raise error

    def _send(self) -> None:
        """Write the current buffer in the background and hash it meanwhile (both only read it),
        then move on to the next one."""
        index, length = self._current, self._filled
        buffer = self._buffers[index]
        end = -(-length // ALIGN) * ALIGN if self._direct else length
        if end > length:
            buffer[length:end] = bytes(end - length)
            self._padded = True
        self._writes[index] = self._io.submit(self._write_at, buffer[:end], self._offset)
        self._offset += length
        self._current = (index + 1) % len(self._buffers)
        self._filled = 0
        self._hash.update(buffer[:length])

    def _wait_for_write(self, index: int) -> None:
        write, self._writes[index] = self._writes[index], None
        if write is not None:
            write.result()

    def _write_at(self, view: memoryview, offset: int) -> None:
        """On the I/O thread, one buffer after the other: no other thread touches the descriptor."""
        start, length = offset, view.nbytes
        while view.nbytes:
            try:
                written = os.pwrite(self._fd, view, offset)
            except OSError as error:
                if error.errno != errno.EINVAL or not self._direct:
                    raise
                self._through_page_cache()
                continue
            view = view[written:]
            offset += written
        if not self._direct:
            self._start_writeback(start, length)

    def _start_writeback(self, offset: int, length: int) -> None:
        """Ask the kernel to write ``length`` bytes at ``offset`` out now; a hint, so where the
        call is missing or refused (some FUSE and network file systems) the fsync does it all."""
        if self._writeback is not None:
            try:
                os.posix_fadvise(self._fd, offset, length, self._writeback)
            except OSError:
                self._writeback = None

    def _through_page_cache(self) -> None:
        """``O_DIRECT`` was refused at a write: go on without it (what was written stays)."""
        os.close(self._fd)
        self._fd = os.open(self._path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        self._direct = False

    @property
    def direct(self) -> bool:
        """Whether the file is (still) written past the page cache."""
        return self._direct

    @property
    def path(self) -> Path:
        return self._path

    @property
    def pages_cached(self) -> bool:
        """Whether the file's pages stay in the page cache once it is synced (``sync`` drops
        them unless ``keep_pages``, or where the kernel takes no hint)."""
        return not self._direct and (self._keep_pages or self._writeback is None)

    def flush(self) -> None:
        """Part of the file protocol ``torch.save`` writes through; the bytes reach the disk in
        ``finish()`` (write, fsync), so there is nothing to do here."""
        return None

    def finish(self) -> dict[str, Any]:
        """Write the rest, wait for every write, fsync, close; returns the manifest entry."""
        entry = self.complete()
        self.sync()
        return entry

    def complete(self) -> dict[str, Any]:
        """Write the rest and wait for every write: the file is whole (cut to its size), not yet
        durable; returns the manifest entry. ``sync`` makes it durable. Between the two, the
        caller may write its next files while this one's writeback drains (``CheckpointStore``)."""
        if self._filled:
            self._send()
        for index in range(len(self._buffers)):
            self._wait_for_write(index)
        if self._padded:
            os.ftruncate(self._fd, self.bytes)
            self._padded = False
        return {"bytes": self.bytes, "digest": str(self._hash.hexdigest())}

    def sync(self) -> None:
        """fsync and close (after ``complete``)."""
        os.fsync(self._fd)
        if self._direct or self._writeback is None or self._keep_pages:
            os.close(self._fd)
        else:  # durable now; dropping its clean pages (~12 ms per 200 MB) need not delay the save
            self._drops.submit(self._drop_pages_and_close)

    def _drop_pages_and_close(self) -> None:
        """On ``drops``' thread (the store's own: on the I/O thread the next file's first write
        would wait ~12 ms per 200 MB behind it, which a save of one large file and a small one paid
        in full), once the file is durable: its pages are clean, so this drops them from the page
        cache, leaving it to the training data."""
        try:
            self._start_writeback(0, 0)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        for write in self._writes:
            if write is not None:
                write.exception()
        os.close(self._fd)


def tensor_bytes(obj: Any) -> int:
    """About how many bytes ``torch.save(obj)`` writes: its tensors' storages (whole: a view's
    storage is saved whole), through dicts, lists and tuples; the rest is small. Tied tensors
    count twice: an estimate, to choose a file's way of writing before it is written."""
    if isinstance(obj, torch.Tensor):
        try:
            return int(obj.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without storage of their own (DTensor)
            return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def rehearse() -> None:
    """Serialize a small tensor into memory as a save would: what torch's serializer does at its
    first use in a process (it imports ``torch.utils.serialization``, ~15 ms here) is done now, not
    in the first save. ``CheckpointStore.prepare`` calls it in RESTORE."""
    serialize({"rehearsal": torch.zeros(4)}, BytesIO())


def serialize(obj: Any, writer: DurableWriter | IO[bytes]) -> None:
    """``torch.save(obj, writer)``, without torch's per-record crc32 where this torch allows it.

    The crc32 is half of a plain ``torch.save``'s time here (0.05 of 0.10 s per 200 MB) and adds
    nothing: the manifest's checksums cover every byte, and a load checks them before torch reads
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


activity.name(DurableWriter.write, "a checkpoint file write")
activity.name(DurableWriter._wait_for_write, "waiting for a checkpoint file write (the store's I/O thread)")
activity.name(DurableWriter.finish, "a checkpoint file's last write and fsync")
activity.name(write_durable, "a checkpoint's durable write (manifest or pointer)")
activity.name(fsync_dir, "an fsync of a checkpoint directory")
activity.name(file_sums, "checksumming a checkpoint file")
