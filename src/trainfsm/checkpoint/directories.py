"""The step directories under a store's root, and who wrote each: the store shares its root.

A directory named for a step (``1000``, ``5000_keep``: ``manifest.parse_step``) is a checkpoint of
trainfsm's when it holds our manifest, which trainfsm writes before the directory gets a step's
name; of trainloop's when it holds trainloop's files and no manifest (it loads through
``trainfsm.checkpoint.trainloop``); of no one known otherwise. Only trainfsm's may be replaced by a
save or deleted by pruning: the others are ``foreign`` (``CheckpointStore.foreign``), and a save at
their step fails with ``foreign_in_the_way``'s words rather than touch them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from trainfsm.checkpoint.manifest import MANIFEST, parse_step
from trainfsm.checkpoint.trainloop import is_trainloop

#: Who wrote a step directory (``Checkpoint.written_by``): trainfsm (it has our manifest), trainloop
#: (its files, no manifest: ``trainfsm.checkpoint.trainloop``), or None for anything else under that name.
TRAINFSM: Final = "trainfsm"
TRAINLOOP: Final = "trainloop"


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


def step_directories(root: Path) -> list[Checkpoint]:
    """Every step directory under ``root``, whoever wrote it (``written_by``), oldest first."""
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        # None yet; or, on a rank other than 0, the empty root that rank 0 made to measure the
        # disk in RESTORE (``CheckpointStore.prepare``) and removed again between a check and this listing.
        return []
    found = []
    for entry in entries:
        parsed = parse_step(entry.name)
        if parsed is not None and entry.is_dir() and not entry.is_symlink():
            found.append(Checkpoint(parsed[0], entry, parsed[1], written_by(entry)))
    return sorted(found, key=lambda c: (c.step, c.kept))


def foreign_in_the_way(path: Path, step: int) -> str:
    """Why a save at ``step`` cannot use ``path``, and what to do."""
    writer = "trainloop" if is_trainloop(path) else "something other than trainfsm"
    return (
        f"{path} was written by {writer} (it has no {MANIFEST}), and this run saves step {step} there; "
        f"trainfsm never replaces or deletes a directory it did not write. Move it out of {path.parent} "
        f"(or delete it if you no longer need it), or give CheckpointingHook another path=."
    )


def ours(path: Path) -> bool:
    """A directory with our manifest (trainfsm writes it before the directory gets a step's name);
    a symlink never is: trainfsm names checkpoints with real directories only."""
    return path.is_dir() and not path.is_symlink() and (path / MANIFEST).is_file()


def written_by(path: Path) -> str | None:
    if (path / MANIFEST).is_file():
        return TRAINFSM
    return TRAINLOOP if is_trainloop(path) else None
