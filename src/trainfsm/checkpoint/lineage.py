"""Which checkpoints belong to the timeline a run continues, and which ones a rollback abandoned.

Steps alone cannot tell apart two cases that ``load="latest"`` must treat oppositely:

- a save killed after its rename but before ``latest`` moved leaves a checkpoint newer than
  ``latest``'s target: the newest of the run's timeline, to be resumed from;
- a run told to start from an older checkpoint (``load=`` one, or ``load=None``) that saved leaves
  the newer checkpoints of the run it rolled back: a timeline nobody continues, and resuming from
  one would throw the rollback's steps away.

So every manifest records two things (``SEQUENCE``, ``RESUMED``): its save's place in the store's
order of writing (one more than the highest there when it was written), and where the run that
wrote it started: the step it started from, and the highest sequence on disk then. A run that
starts from step ``r`` declares every checkpoint written before it past step ``r`` not its past,
so a checkpoint is **abandoned** when some manifest on disk says ``resumed`` at a step below its
own, after it was written. A save that died before ``latest`` moved is abandoned by no run that
started before it (it was written after their starts), only by a later run told to start earlier.
Which step a run starts from is the hook's to say
(``trainfsm.checkpoint.restore.start_timeline``): the loaded checkpoint's for ``load=`` a name or
a path, 0 for ``load=None``, and for ``load="latest"`` the newest step it could have loaded, so
that a checkpoint skipped because a read failed once is not abandoned for it.

``CheckpointStore.candidates`` never offers an abandoned checkpoint to ``load="latest"``, and
``prune`` never deletes one (nor counts it in ``keep_previous``): it stays on disk and loads by
name, until its owner deletes it; a rollback must not cost the run it rolled back. The
information lives as long as one checkpoint of the rolling-back run does, and every later run's
start repeats it for the abandoned checkpoints past its own start step.

A trainfsm checkpoint without a sequence (written by a version before it recorded one) was written
before any that has one: sequence 0, abandoned by a later rollback like any other, abandoning
nothing. Only trainfsm's checkpoints take part; trainloop's are ordered by step, as before.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from trainfsm.checkpoint.manifest import MANIFEST, RESUMED, SEQUENCE


class Written(NamedTuple):
    """What a manifest says of its checkpoint's place in the store's history."""

    sequence: int  # its place in the store's order of writing
    resumed: tuple[int, int] | None  # (step, highest sequence then) where its run started; None if unknown


class Manifests:
    """Each checkpoint's ``Written``, read from its manifest once: a manifest is known by its inode
    and mtime, so a step saved again (a new manifest) is read again. ``prune`` asks at every save,
    and a store may hold many kept checkpoints: a stat each, not a parse each."""

    def __init__(self) -> None:
        self._known: dict[Path, tuple[int, int, Written | None]] = {}  # path -> (inode, mtime_ns, written)

    def of(self, checkpoint: Path) -> Written | None:
        """``checkpoint``'s place in the history; None where its manifest has none or cannot be read."""
        manifest = checkpoint / MANIFEST
        try:
            stat = os.stat(manifest)
        except OSError:
            return None
        known = self._known.get(checkpoint)
        if known is not None and known[:2] == (stat.st_ino, stat.st_mtime_ns):
            return known[2]
        try:
            written = read_written(json.loads(manifest.read_text()))
        except (OSError, ValueError, UnicodeDecodeError):
            written = None
        self._known[checkpoint] = (stat.st_ino, stat.st_mtime_ns, written)
        return written

    def highest(self, checkpoints: Iterable[Path]) -> int:
        """The highest sequence among ``checkpoints`` (0 where none has one): a new save's is one more."""
        return max((w.sequence for w in map(self.of, checkpoints) if w is not None), default=0)


def read_written(manifest: Any) -> Written | None:
    """The ``Written`` of a parsed manifest: sequence 0 and no start where it records none (an
    earlier version's, written before every manifest that has one); None for no manifest at all."""
    if not isinstance(manifest, dict):
        return None
    sequence = _int(manifest.get(SEQUENCE))
    if sequence is None:
        return Written(0, None)
    resumed = manifest.get(RESUMED)
    step, before = (
        (_int(resumed.get("step")), _int(resumed.get("sequence"))) if isinstance(resumed, dict) else (None, None)
    )
    return Written(sequence, None if step is None or before is None else (step, before))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def abandoned(checkpoints: Iterable[tuple[int, Path]], manifests: Manifests) -> set[Path]:
    """Of ``checkpoints`` ((step, path) pairs), those written before a run that resumed from an
    earlier step started (see the module doc). Newest-written first, with each run start that
    came after the checkpoint was written folded into the lowest start step so far."""
    written = [(w, step, path) for step, path in checkpoints if (w := manifests.of(path)) is not None]
    starts = sorted({w.resumed for w, _, _ in written if w.resumed is not None}, key=lambda s: s[1], reverse=True)
    lowest: float = math.inf
    out = set()
    next_start = 0
    for w, step, path in sorted(written, key=lambda x: x[0].sequence, reverse=True):
        while next_start < len(starts) and starts[next_start][1] >= w.sequence:  # started after it was written
            lowest = min(lowest, starts[next_start][0])
            next_start += 1
        if step > lowest:
            out.add(path)
    return out
