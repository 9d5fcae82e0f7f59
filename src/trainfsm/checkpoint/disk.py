"""What the disk under a checkpoint store allows: writing over a file only where nothing else sees
it, and taking room without writing it.

``CheckpointStore`` writes a save over a pruned checkpoint's files, which is faster than writing
new ones (``CheckpointStore.prune``). That is safe only where no one else sees those bytes: a hard
link to the file (``cp -al``, ``rsync --link-dest``, ``ln`` to pin a step) or a reader that has it
open (an evaluation or upload job) would find a later step's weights under the pruned step's name,
and a plain ``torch.load`` raises nothing. ``unshared`` says when a file may be written over.

RESTORE takes the room of the run's checkpoints (``CheckpointStore.reserve``) with ``allocate``: the
blocks without a byte written (where the file system cannot, a check of its free space), so that a
disk without room fails there and not at a save an hour later.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Final

#: File systems whose files this host alone opens (statfs's f_type), so that a lease taken here
#: sees every reader. Elsewhere (NFS, Lustre, GPFS, CephFS, FUSE ...) a reader on another node
#: is invisible to this host's leases, so nothing there is written over.
LOCAL_FILE_SYSTEMS: Final = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0xF2F52010: "f2fs",
    0x2FC12FC1: "zfs",
    0xCA451A4E: "bcachefs",
}
_STATFS_BYTES: Final = 256  # larger than any platform's struct statfs


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - a platform without a C library to ask
        return None


_LIBC: Final = _libc() if sys.platform.startswith("linux") else None


def file_system(path: Path) -> str | None:
    """The local file system ``path`` is on (``LOCAL_FILE_SYSTEMS``), or None for any other."""
    if _LIBC is None:
        return None
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if _LIBC.statfs(os.fsencode(path), buffer) != 0:
        return None
    # f_type is struct statfs's first field, a long on Linux's 64- and 32-bit ABIs (where it is
    # not, s390x's, the value matches no local file system: nothing is written over).
    return LOCAL_FILE_SYSTEMS.get(ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF)


def unshared(path: Path) -> bool:
    """Whether only the store sees ``path``'s bytes, so that a save may write over them: one name
    (``st_nlink == 1``) and no open file description on this host, this process's included (the
    kernel grants a write lease only then; it is taken and released at once), on a local file system. False
    where any of this cannot be known: leases refused (``/proc/sys/fs/leases-enable`` 0, a file
    system without them) or a network file system.

    Ask after the file's old name is gone (renamed into the recycle bin, or into the save's
    directory), so that no one opens it by that name after the answer.
    """
    if not hasattr(fcntl, "F_SETLEASE") or file_system(path) is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if os.fstat(fd).st_nlink != 1:
            return False
        # A process that opens the file while the lease is held breaks it, and the kernel signals
        # the holder: SIGIO unless told otherwise, whose default action ends the process. SIGURG's
        # default is to ignore it (and the open waits only until the lease is released, below).
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:  # EAGAIN: open elsewhere (or here); EINVAL, EACCES: no lease to be had
            return False
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    finally:
        os.close(fd)


def allocate(directory: Path, sizes: Iterable[tuple[str, int]]) -> int:
    """Make each file (name in ``directory``, bytes) with its blocks allocated and nothing written
    (``fallocate``: reads as zeros, a later write converts the blocks in place); returns the bytes
    allocated. Where the file system cannot allocate without writing (some network and FUSE file
    systems), the files are not made and its free space is checked against their bytes instead.

    OSError ENOSPC (or EDQUOT) where the room is not there; a file whose allocation failed is
    deleted, those made before it stay.
    """
    wanted = list(sizes)
    fallocate = getattr(_LIBC, "fallocate64", None) or getattr(_LIBC, "fallocate", None)
    if fallocate is not None:
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    allocated = 0
    for index, (name, nbytes) in enumerate(wanted):
        path = directory / name
        if fallocate is None:
            return allocated + _check_free(directory, sum(n for _, n in wanted[index:]))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            failed = fallocate(fd, 0, 0, nbytes) != 0
            error = ctypes.get_errno() if failed else 0
        finally:
            os.close(fd)
        if error:
            path.unlink(missing_ok=True)
            if error in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return allocated + _check_free(directory, sum(n for _, n in wanted[index:]))
            raise OSError(error, f"{os.strerror(error)} (allocating {nbytes} bytes for {path})")
        allocated += nbytes
    return allocated


def _check_free(directory: Path, nbytes: int) -> int:
    """Nothing allocated (returns 0); ENOSPC where ``directory``'s file system has less than ``nbytes`` free."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free, {nbytes} needed)")
    return 0
