"""Crash states of a real checkpoint save, as a power cut may leave them (ALICE / CrashMonkey style).

``record(root, action)`` runs ``action`` (a real ``CheckpointStore.save``, prune included) while it
records every file-system operation under ``root``: file creation, writes with their bytes and
offsets, truncation, fsync of a file or of a directory, mkdir, rename, symlink, unlink, rmdir.
The ``os`` functions the store and ``shutil.rmtree`` call are wrapped, and so is ``open`` (``io.open``,
which ``pathlib`` and torch.distributed.checkpoint's writer use too) for files opened to write.

``crash_states(trace)`` then builds, for every prefix of the operations (a crash after the k-th),
the states POSIX allows, with this persistence model:

- a write or truncation of a file is durable once the file is fsynced after it;
- a name operation (create, mkdir, rename, symlink, unlink, rmdir) is durable once the directory
  it changes (both, for a rename) is fsynced after it;
- anything not yet durable may be lost, independently of the rest.

All 2^n subsets of the pending operations are too many; as ALICE does, each prefix gives: all of
them applied, none of them applied, each one alone lost, and each pending write half applied
(unsynced file data partly present). ``materialize(state, directory)`` writes a state out as real
files for the loader to read.
"""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Op = tuple[Any, ...]


@dataclass
class Trace:
    """The tree before the action (all durable) and the operations the action made."""

    initial: dict[str, tuple[Any, ...]]  # path (relative) -> ("dir", id) | ("file", id) | ("link", target)
    data: dict[int, bytes]  # file inode id -> its bytes before the action
    ops: list[Op] = field(default_factory=list)


class _Recorder:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.next_id = 0
        self.paths: dict[str, tuple[Any, ...]] = {}  # the live tree, as the action changes it
        self.fds: dict[int, tuple[str, Any]] = {}  # fd -> (relative path, inode id or None for a dir)
        self.ops: list[Op] = []

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def rel(self, path: Any, dir_fd: int | None = None) -> str | None:
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            base = self.fds.get(dir_fd)
            if base is None:
                return None
            full = os.path.join(str(self.root), base[0], path) if base[0] else os.path.join(str(self.root), path)
        else:
            full = os.path.abspath(path)
        full = os.path.normpath(full)
        root = str(self.root)
        if full == root:
            return ""
        if not full.startswith(root + os.sep):
            return None
        return full[len(root) + 1 :]

    def parent_id(self, rel: str) -> Any:
        parent = os.path.dirname(rel)
        entry = self.paths.get(parent)
        return entry[1] if entry and entry[0] == "dir" else None

    def move(self, src: str, dst: str) -> None:
        moved = {p: e for p, e in self.paths.items() if p == src or p.startswith(src + os.sep)}
        for p in moved:
            del self.paths[p]
        for p in [p for p in self.paths if p == dst or p.startswith(dst + os.sep)]:
            del self.paths[p]
        for p, e in moved.items():
            self.paths[dst + p[len(src) :]] = e


def _scan(root: Path, recorder: _Recorder) -> tuple[dict[str, tuple[Any, ...]], dict[int, bytes]]:
    initial: dict[str, tuple[Any, ...]] = {"": ("dir", recorder.new_id())}
    data: dict[int, bytes] = {}
    for directory, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            path = Path(directory) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                initial[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                initial[rel] = ("dir", recorder.new_id())
            else:
                inode = recorder.new_id()
                initial[rel] = ("file", inode)
                data[inode] = path.read_bytes()
    return initial, data


def record(root: Path, action: Callable[[], Any]) -> Trace:
    """Run ``action`` and record what it does to the files under ``root`` (see the module doc)."""
    recorder = _Recorder(root)
    initial, data = _scan(root, recorder)
    recorder.paths = dict(initial)
    real = {name: getattr(os, name) for name in ("open", "pwrite", "ftruncate", "fsync", "close", "mkdir", "rename",
                                                  "replace", "symlink", "unlink", "rmdir")}  # fmt: skip
    ops = recorder.ops

    def rec_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        rel = recorder.rel(path, dir_fd)
        existed = rel is not None and rel in recorder.paths
        fd = real["open"](path, flags, mode, dir_fd=dir_fd)
        if rel is None:
            return fd
        if not existed and flags & os.O_CREAT:
            inode = recorder.new_id()
            recorder.paths[rel] = ("file", inode)
            ops.append(("create", rel, inode, recorder.parent_id(rel)))
        entry = recorder.paths.get(rel)
        if entry is None:
            return fd
        if entry[0] == "file" and existed and flags & os.O_TRUNC:
            ops.append(("truncate", entry[1], 0))
        recorder.fds[fd] = (rel, entry[1] if entry[0] in ("file", "dir") else None)
        return fd

    def rec_pwrite(fd: int, data: Any, offset: int) -> int:
        written = real["pwrite"](fd, data, offset)
        if fd in recorder.fds:
            ops.append(("write", recorder.fds[fd][1], offset, bytes(memoryview(data)[:written])))
        return int(written)

    def rec_ftruncate(fd: int, size: int) -> None:
        real["ftruncate"](fd, size)
        if fd in recorder.fds:
            ops.append(("truncate", recorder.fds[fd][1], size))

    def rec_fsync(fd: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        real["fsync"](fd)
        if fd in recorder.fds:
            rel, inode = recorder.fds[fd]
            kind = recorder.paths.get(rel, ("?",))[0]
            ops.append(("fsync_dir", inode) if kind == "dir" else ("fsync_file", inode))

    def rec_close(fd: int) -> None:
        recorder.fds.pop(fd, None)
        real["close"](fd)

    def rec_mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real["mkdir"](path, mode, dir_fd=dir_fd)
        rel = recorder.rel(path, dir_fd)
        if rel is not None:
            inode = recorder.new_id()
            recorder.paths[rel] = ("dir", inode)
            ops.append(("mkdir", rel, inode, recorder.parent_id(rel)))

    def rec_rename(name: str) -> Callable[..., None]:
        def rename(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
            real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            a, b = recorder.rel(src, src_dir_fd), recorder.rel(dst, dst_dir_fd)
            if a is not None and b is not None:
                parents = (recorder.parent_id(a), recorder.parent_id(b))
                recorder.move(a, b)
                ops.append(("rename", a, b, parents))

        return rename

    def rec_symlink(target: Any, path: Any, target_is_directory: bool = False, *, dir_fd: int | None = None) -> None:
        real["symlink"](target, path, target_is_directory, dir_fd=dir_fd)
        rel = recorder.rel(path, dir_fd)
        if rel is not None:
            recorder.paths[rel] = ("link", os.fsdecode(target))
            ops.append(("symlink", os.fsdecode(target), rel, recorder.parent_id(rel)))

    def rec_remove(name: str) -> Callable[..., None]:
        def remove(path: Any, *, dir_fd: int | None = None) -> None:
            rel = recorder.rel(path, dir_fd)
            parent = recorder.parent_id(rel) if rel is not None else None
            real[name](path, dir_fd=dir_fd)
            if rel is not None:
                recorder.paths.pop(rel, None)
                ops.append((name, rel, parent))

        return remove

    class RecordedFile:
        """``open(path, "wb")`` in trainfsm.checkpoint.store: writes and fsyncs recorded."""

        def __init__(self, path: Any, mode: str, *args: Any, **kwargs: Any) -> None:
            self._file = real_open(path, mode, *args, **kwargs)
            self._rel = recorder.rel(path)
            if self._rel is not None:
                entry = recorder.paths.get(self._rel)
                if entry is None:
                    inode = recorder.new_id()
                    recorder.paths[self._rel] = ("file", inode)
                    ops.append(("create", self._rel, inode, recorder.parent_id(self._rel)))
                else:
                    ops.append(("truncate", entry[1], 0))
                recorder.fds[self._file.fileno()] = (self._rel, recorder.paths[self._rel][1])

        def write(self, data: Any) -> int:
            offset = self._file.tell()
            written = self._file.write(data)
            if self._rel is not None:
                ops.append(("write", recorder.paths[self._rel][1], offset, bytes(data)))
            return int(written)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

        def close(self) -> None:
            if not self._file.closed:
                recorder.fds.pop(self._file.fileno(), None)
            self._file.close()

        def __enter__(self) -> RecordedFile:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.close()

    real_open = io.open

    def rec_io_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        writing = isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+")
        if writing and recorder.rel(file) is not None:
            return RecordedFile(file, mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    patched = {
        "open": rec_open,
        "pwrite": rec_pwrite,
        "ftruncate": rec_ftruncate,
        "fsync": rec_fsync,
        "close": rec_close,
        "mkdir": rec_mkdir,
        "rename": rec_rename("rename"),
        "replace": rec_rename("replace"),
        "symlink": rec_symlink,
        "unlink": rec_remove("unlink"),
        "rmdir": rec_remove("rmdir"),
    }
    for name, function in patched.items():
        setattr(os, name, function)
    io.open = builtins.open = rec_io_open  # type: ignore[assignment]
    try:
        action()
    finally:
        for name, function in real.items():
            setattr(os, name, function)
        io.open = builtins.open = real_open  # type: ignore[assignment]
    return Trace(initial, data, _coalesced(ops))


def _continues(last: Op, op: Op) -> bool:
    """Whether ``op`` writes on in the same file right where the write ``last`` ended."""
    return op[0] == last[0] == "write" and op[1] == last[1] and op[2] == last[2] + len(last[3])


def _coalesced(ops: list[Op]) -> list[Op]:
    """Back-to-back writes that continue one another in one file become one write (DCP writes a
    shard in hundreds of small pieces): a crash may still tear it, which ``half written`` covers."""
    out: list[Op] = []
    for op in ops:
        last = out[-1] if out else None
        if last is not None and _continues(last, op):
            out[-1] = ("write", op[1], last[2], last[3] + op[3])
            continue
        out.append(op)
    return out


# ---------------------------------------------------------------- crash states
def _durable(ops: list[Op], k: int) -> list[bool]:
    """For each of the first ``k`` operations: made durable by a later fsync before the crash?"""
    out = []
    for i in range(k):
        op = ops[i]
        later = ops[i + 1 : k]
        kind = op[0]
        if kind in ("write", "truncate"):
            durable = any(o[0] == "fsync_file" and o[1] == op[1] for o in later)
        elif kind in ("create", "mkdir", "symlink"):
            durable = any(o[0] == "fsync_dir" and o[1] == op[3] for o in later)
        elif kind in ("unlink", "rmdir"):
            durable = any(o[0] == "fsync_dir" and o[1] == op[2] for o in later)
        elif kind == "rename":
            durable = all(any(o[0] == "fsync_dir" and o[1] == parent for o in later) for parent in op[3])
        else:  # the fsyncs themselves
            durable = True
        out.append(durable)
    return out


def crash_states(trace: Trace) -> Iterator[tuple[str, dict[str, tuple[Any, ...]], dict[int, bytes]]]:
    """(description, tree, file data) of every crash state (see the module doc)."""
    ops = trace.ops
    for k in range(len(ops) + 1):
        durable = _durable(ops, k)
        pending = [i for i in range(k) if not durable[i]]
        yield f"crash after op {k}, everything applied", *_replay(trace, ops[:k], set(), {})
        if not pending:
            continue
        yield f"crash after op {k}, every pending op lost", *_replay(trace, ops[:k], set(pending), {})
        for i in pending:
            yield f"crash after op {k}, op {i} {ops[i][:2]} lost", *_replay(trace, ops[:k], {i}, {})
            if ops[i][0] == "write" and len(ops[i][3]) > 1:
                yield f"crash after op {k}, op {i} half written", *_replay(trace, ops[:k], set(), {i: 0.5})


def killed_after(trace: Trace, k: int) -> tuple[dict[str, tuple[Any, ...]], dict[int, bytes]]:
    """(tree, file data) that a SIGKILL after the ``k``-th operation leaves: all ``k`` applied, as
    the page cache outlives the process (a power cut's states are ``crash_states``)."""
    return _replay(trace, trace.ops[:k], set(), {})


def _replay(
    trace: Trace, ops: list[Op], lost: set[int], partial: dict[int, float]
) -> tuple[dict[str, tuple[Any, ...]], dict[int, bytes]]:
    tree = dict(trace.initial)
    data = {inode: bytearray(content) for inode, content in trace.data.items()}
    for index, op in enumerate(ops):
        if index in lost:
            continue
        kind = op[0]
        if kind == "create":
            if os.path.dirname(op[1]) in tree:
                tree[op[1]] = ("file", op[2])
                data.setdefault(op[2], bytearray())
        elif kind == "mkdir":
            if os.path.dirname(op[1]) in tree:
                tree[op[1]] = ("dir", op[2])
        elif kind == "symlink":
            if os.path.dirname(op[1 + 1]) in tree:
                tree[op[2]] = ("link", op[1])
        elif kind == "write":
            content = op[3][: max(1, int(len(op[3]) * partial[index]))] if index in partial else op[3]
            buffer = data.setdefault(op[1], bytearray())
            end = op[2] + len(content)
            if len(buffer) < end:
                buffer.extend(bytes(end - len(buffer)))
            buffer[op[2] : end] = content
        elif kind == "truncate":
            buffer = data.setdefault(op[1], bytearray())
            del buffer[op[2] :]
            buffer.extend(bytes(max(0, op[2] - len(buffer))))
        elif kind == "rename":
            src, dst = op[1], op[2]
            if src in tree and os.path.dirname(dst) in tree:
                moved = {p: e for p, e in tree.items() if p == src or p.startswith(src + os.sep)}
                for p in moved:
                    del tree[p]
                for p in [p for p in tree if p == dst or p.startswith(dst + os.sep)]:
                    del tree[p]
                for p, e in moved.items():
                    tree[dst + p[len(src) :]] = e
        elif kind in ("unlink", "rmdir"):
            tree.pop(op[1], None)
    return tree, {inode: bytes(content) for inode, content in data.items()}


def materialize(tree: dict[str, tuple[Any, ...]], data: dict[int, bytes], directory: Path) -> None:
    """Write a crash state out as real files under ``directory``."""
    for rel in sorted(tree, key=lambda p: p.count(os.sep)):
        entry = tree[rel]
        path = directory / rel if rel else directory
        if entry[0] == "dir":
            path.mkdir(parents=True, exist_ok=True)
        elif entry[0] == "file":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data.get(entry[1], b""))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(entry[1])
