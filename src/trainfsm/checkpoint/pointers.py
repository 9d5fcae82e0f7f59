"""A store's pointers (``latest``, ``best``, ...): names of checkpoint directories, moved atomically.

A pointer is a relative symlink beside the step directories, or a one-line file where the file
system allows no links. It moves by a new link renamed over the old one, so a reader sees the old
target or the new one, never neither. ``latest`` moves only once a save is complete and renamed
into place, and pruning never deletes a pointer's target, so a pointer never names a deleted
checkpoint.

A pointer that should name a checkpoint not written yet (``CheckpointingHook``'s ``best`` after an
evaluation) is registered with ``when_saved`` and moved by the save itself (``move_due``), right
after ``latest`` and before anything is pruned, on the thread that writes it: pointing after
``save`` returns would race an asynchronous writer's prune, which may delete the new target before
the pointer protects it.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Final

from trainfsm.checkpoint.io import fsync_dir, write_durable
from trainfsm.checkpoint.manifest import MANIFEST, parse_step
from trainfsm.checkpoint.replace import TMP_PREFIX

LATEST: Final = "latest"


class Pointers:
    """The pointers under ``root``, and those waiting for a save (``when_saved``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # Pointers to move with a later save: pointer -> first step it may name. Registered on the
        # training thread, applied on the one that saves (an async writer).
        self._due: dict[str, int] = {}
        self._due_lock = threading.Lock()

    def point(self, pointer: str, name: str) -> None:
        """Make ``pointer`` name checkpoint directory ``name``, atomically."""
        check(pointer)
        link = self.root / pointer
        tmp = self.root / f"{TMP_PREFIX}{pointer}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.symlink_to(name, target_is_directory=True)
        except OSError:  # filesystems without symlinks: a one-line file instead
            write_durable(tmp, (name + "\n").encode())
        os.replace(tmp, link)
        fsync_dir(self.root)

    def when_saved(self, pointer: str, step: int) -> None:
        """Move ``pointer`` to the first checkpoint saved at ``step`` or later (``move_due``); a
        later registration for the same pointer replaces an earlier one."""
        check(pointer)
        with self._due_lock:
            self._due[pointer] = step

    def move_due(self, step: int, name: str) -> None:
        """Checkpoint ``step`` is saved as ``name``: move the pointers waiting for it there."""
        with self._due_lock:
            due = [pointer for pointer, first in self._due.items() if first <= step]
            for pointer in due:
                del self._due[pointer]
        for pointer in due:
            self.point(pointer, name)

    def target(self, pointer: str) -> str | None:
        """The checkpoint name ``pointer`` holds (it may name a directory that no longer exists)."""
        return read(self.root / pointer)

    def all(self) -> dict[str, str]:
        """Every pointer under the root and the name it holds."""
        if not self.root.is_dir():
            return {}
        found = {}
        for entry in self.root.iterdir():
            if entry.name.startswith(".") or parse_step(entry.name) is not None:
                continue
            name = read(entry)
            if name is not None:
                found[entry.name] = name
        return found


def check(pointer: str) -> None:
    """A pointer's name is a plain file name that no step directory, manifest or temporary file has."""
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


def read(path: Path) -> str | None:
    """The name a pointer holds: a symlink's target or a one-line file's line; None for anything else."""
    if path.is_symlink():
        return os.readlink(path)
    if path.is_file() and path.stat().st_size <= 4096:  # a pointer is one short line, not a data file
        try:
            return path.read_text().strip() or None
        except UnicodeDecodeError:
            return None
    return None
