"""A checkpoint renamed into place over an older copy of its step, and what RESTORE does with the
copies a kill left on the way: there is never a moment without a complete copy of a step.

A step is saved again when a run resumed from an older checkpoint (``load=`` one, or a corrupt newer
one skipped) reaches a step already on disk. ``put_in_place`` renames the old copy aside
(``.tmp-old-<name>-<nonce>``), the new one in, fsyncs the root (both renames durable), and only then
deletes the old one. ``complete_interrupted``, in RESTORE, finishes what a kill left: a save's
temporary directory that is complete goes into place (over an older copy: the new one is what the
save meant to keep), and an old copy moved aside goes back where no copy of its step is left.

Not ``renameat2(RENAME_EXCHANGE)``, which would swap the two copies in one step: NFS, Lustre and
GPFS, where clusters keep checkpoints, refuse it, so the rename-aside order is needed anyway, and
one order is one to test (``tests/test_durability.py`` builds its crash states); a swap would also
leave the old copy under a new one's temporary name, for RESTORE to tell from a new one.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Final

from trainfsm.checkpoint.io import fsync_dir
from trainfsm.checkpoint.manifest import KEEP_SUFFIX, MANIFEST, parse_step, written_whole

#: The prefix of every temporary name under a store's root (``trainfsm.checkpoint.store.TMP_PREFIX``):
#: RESTORE removes what a crash left under it.
TMP_PREFIX: Final = ".tmp-"
ASIDE: Final = f"{TMP_PREFIX}old-"  # an old copy a re-save moved aside: .tmp-old-<name>-<nonce>


def put_in_place(root: Path, tmp: Path, name: str) -> None:
    """Rename the complete checkpoint ``tmp`` to ``root / name``, durably, over the copy of its step
    there (the caller's: trainfsm replaces only its own), if any: a kept save (``<step>_keep``)
    replaces both copies, an unkept one only ``<step>``, never a kept copy, which someone pinned
    (``keep_steps``, ``keep_interval``), maybe in a run a rollback abandoned."""
    step = name.removesuffix(KEEP_SUFFIX)
    aside: list[tuple[Path, Path]] = []
    for existing in {root / step, root / name}:
        if existing.exists():
            moved = root / f"{ASIDE}{existing.name}-{uuid.uuid4().hex[:8]}"
            existing.rename(moved)
            aside.append((moved, existing))
    try:
        tmp.rename(root / name)
    except BaseException:
        for moved, existing in aside:  # the save failed, not the step: its old copy goes back
            moved.rename(existing)
        raise
    fsync_dir(root)  # the new copy is in for good before the old one goes
    for moved, _ in aside:
        shutil.rmtree(moved, ignore_errors=True)


def complete_interrupted(root: Path) -> list[str]:
    """Finish what a kill interrupted once a checkpoint was complete; returns the names put in place.

    A save's temporary directory (``.tmp-<step>-<nonce>``) whose manifest lists its files at their
    sizes (``written_whole``) lacked only its rename: it goes into place (``put_in_place``), unless
    a directory trainfsm did not write holds its step's name. An old copy moved aside goes back
    where no copy of its step is left; the caller deletes the rest (``remove_leftovers``).
    """
    if not root.is_dir():
        return []
    whole: dict[str, tuple[float, Path]] = {}  # name -> (when written, temporary directory)
    asides = []
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(TMP_PREFIX) or not entry.is_dir() or entry.is_symlink():
            continue
        kind = entry.name[len(TMP_PREFIX) :].rsplit("-", 1)[0]
        if entry.name.startswith(ASIDE):
            asides.append((entry, entry.name[len(ASIDE) :].rsplit("-", 1)[0]))
        elif kind.isdigit() and (manifest := written_whole(entry, int(kind))) is not None:
            name = f"{kind}{KEEP_SUFFIX}" if manifest.get("kept") else kind
            if not any(_foreign(root / n) for n in (kind, f"{kind}{KEEP_SUFFIX}")):
                whole[name] = max(whole.get(name, (-1.0, entry)), (float(manifest.get("created", 0)), entry))
    done = []
    for name, (_, tmp) in sorted(whole.items()):
        put_in_place(root, tmp, name)
        done.append(name)
    for entry, name in asides:
        parsed = parse_step(name)
        copies = [] if parsed is None else [root / str(parsed[0]), root / f"{parsed[0]}{KEEP_SUFFIX}"]
        if copies and not any(p.exists() for p in copies) and (entry / MANIFEST).is_file():
            entry.rename(root / name)
            fsync_dir(root)
            done.append(name)
    return done


def _foreign(path: Path) -> bool:
    """Something under a step's name without our manifest: never replaced (``store.foreign``)."""
    exists = path.exists() or path.is_symlink()
    return exists and not (path.is_dir() and not path.is_symlink() and (path / MANIFEST).is_file())
