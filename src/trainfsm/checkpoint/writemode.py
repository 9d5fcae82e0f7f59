"""How a store writes its files: through the page cache (each 4 MiB's writeback started at once) or
past it (``O_DIRECT``), measured on the checkpoint's own file system and chosen, or forced.

Which way is faster depends on the storage, and on the same class of machine it changed: issue 14
measured the page cache twice as fast as ``O_DIRECT`` (1 GB in 1.6 s against 3.2 s); a few months
later, issue 35 measured the other way round (0.41 s per GB through the page cache, 0.27 s with
``O_DIRECT``), and on that disk the page cache was the faster for files of tens of MB and the
slower for files of a GB. So with ``direct_io="auto"`` (the default) the store measures:

- **a probe, in RESTORE** (``CheckpointStore.prepare``): each way writes a file of ``PROBE_BYTES``
  (untimed), then writes over it ``PROBE_FILES`` times, in the order page cache, ``O_DIRECT``,
  ``O_DIRECT``, page cache (so that a disk speeding up or slowing down meanwhile favours neither),
  each time through the store's own writer (its staging buffers and I/O thread, a checksum on the
  way) and fsynced; the files are deleted at the end. A way's rate is its faster write's (a hiccup
  of the disk only slows a write down). The writes go over a file because a store's saves do
  (``CheckpointStore.prune`` recycles pruned files, RESTORE reserves the first save's), and the
  page cache's over pages it kept, as a save's do (``DurableWriter(keep_pages=True)``). Measured
  here, 32 MiB: over
  kept files the page cache took 3.1-3.8 GB/s and ``O_DIRECT`` 1.7-2.1 GB/s, as 200 MB and 1 GB
  saves did (2.5-3.7 against 1.6-2.6); into new files the two were 1.7-2.4 and 1.2-1.8 GB/s, and a
  1 GB file through the page cache took 2.6 s after a pause (its pages come from the host again,
  on this virtual machine), 7x its time over kept pages. The probe's files are named like a save's
  temporary directory, so a crash that leaves one is cleaned up in RESTORE;
- **per file, by its size**: a file without saves of its size yet is written the way that probed
  faster. A file's size is the last one of its name (``model``, ``training_state``), or at its
  first save its tensors' bytes;
- **the saves themselves**: each file of ``RATED_BYTES`` or more written over a kept file counts
  for its way and its size (within a factor of two: ``size_class``): its bytes and the seconds from
  serializing it to its fsync; a way's rate at a size is the bytes over the seconds of its last
  ``SAVES_KEPT`` files. A new file does not count: its blocks and, through the page cache, its
  pages are found once (200 MB into fresh pages after a pause: 0.63 s against 0.08 s over kept
  ones), and counting it would leave the page cache for good after one such file. Nor does a
  page-cache write over a file whose pages are not cached (the store knows which it left there:
  ``O_DIRECT`` drops a file's pages, so after a try of ``O_DIRECT`` the page cache's next write
  over that file takes fresh pages; counted, it lost the page cache its place, in 2 of 4 runs of
  the benchmark). When even the fastest of a way's last files (``TRY_AFTER`` of them at least) is
  below the other way's probe by ``TRY_MARGIN``, the next file of that size tries the other way
  (one slow save, which a busy host gives now and then, tries nothing, nor does a slow first
  one); once both ways have files of that size, the faster is used.
  A save's rate is what counts: a probe's small files may flatter a way that a large checkpoint
  does not;
- **a re-check, now and then**: saves' rates count for ``RECHECK_SECONDS``, and the probe runs
  again on a thread of its own after a save once it is that old, holding the store's save lock (a
  save that comes meanwhile waits for it). A way in use is left only for one faster by more than
  ``SWITCH_MARGIN``, so that noise does not flip it back and forth;
- **shared**: one probe per file system (``st_dev``) and process, while it is fresh: the stores of
  a process on one disk do not probe it one after the other.

``direct_io=True`` or ``False`` forces a way and nothing is measured. Where the file system refuses
``O_DIRECT`` (tmpfs, some network or FUSE file systems: at ``open`` or at the first write) the store
writes through the page cache, and says so (``chosen_by="O_DIRECT refused"``). Each choice is in
the trail: ``checkpoint_store_ready`` and every ``checkpoint_saved`` carry ``direct_io``,
``chosen_by`` and ``rates`` (GB/s, ``probe`` and ``saves``, each ``page_cache`` and ``o_direct``;
null where not measured, and when forced). A save's ``chosen_by`` and ``rates`` are its largest
file's, the rates from saves those of that file's size.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from trainfsm import activity
from trainfsm.checkpoint.io import ALIGN, BUFFER_BYTES, DurableWriter, Staging, filler, tensor_bytes

#: What ``direct_io`` may be: a forced way, or "auto" (measured).
SETTINGS: Final = (True, False, "auto")
# Per probe file: large enough that a file's fixed costs (open, the fsync's journal commit, a few ms
# here) do not hide the streaming rate, small enough to cost ~0.1 s. On this machine's disk 16 MiB
# files put the two ways within 7% of each other in a round where 200 MB files differed threefold.
PROBE_BYTES: Final = 32 << 20
PROBE_FILES: Final = 2  # timed writes per way, after each way's first: 192 MiB in all, ~0.1 s here
RECHECK_SECONDS: Final = 600.0
SWITCH_MARGIN: Final = 1.10
# The other way is tried for one file only where its probe promises this much more than the saves
# of the way in use: a try is not free. Here an ``O_DIRECT`` write drops the file's cached pages, so
# the page cache's next write over that file takes fresh ones (1 GB: 3.0 s against 0.3 s), and a
# save's rate counts serializing and checksums that the probe's rate does not (200 MB saves through
# the page cache at 1.8-2.5 GB/s, where its probe gave 2.4-3.4 and ``O_DIRECT``'s 1.6-2.2).
TRY_MARGIN: Final = 1.5
# Files of a way at a size before the other way may be tried: one slow file, the first included,
# tries nothing. The benchmark's store (200 MB, five saves) had its first save through the page
# cache take 0.2 s where the others took 0.07 s; that one file tried ``O_DIRECT``, which then
# kept the place at 0.117 s a save, and the five saves came to 1.14x the faster floor.
TRY_AFTER: Final = 2
SAVES_KEPT: Final = 4  # per way: a rate is their bytes over their seconds
RATED_BYTES: Final = 2 * PROBE_BYTES  # a save this large or larger counts as a measurement of its way
PROBE_PREFIX: Final = ".tmp-probe-"  # store.TMP_PREFIX: leftovers of a crash are removed in RESTORE


@dataclass(frozen=True, slots=True)
class Choice:
    """The way a store writes next, why, and the rates it stands on (GB/s; None where refused or
    not measured): ``{"probe": {"page_cache", "o_direct"}, "saves": {"page_cache", "o_direct"}}``."""

    direct: bool
    #: "measurement" (the probe), "saves" (saves' rates), "trying the other way" (for one save),
    #: "direct_io=True", "direct_io=False" or "O_DIRECT refused"
    chosen_by: str
    rates: dict[str, dict[str, float | None]] | None = None

    def fields(self) -> dict[str, Any]:
        """What ``checkpoint_store_ready`` and ``checkpoint_saved`` record of it."""
        return {"direct_io": self.direct, "chosen_by": self.chosen_by, "rates": self.rates}


def check_direct_io(owner: str, value: Any) -> bool | str:
    if not (isinstance(value, bool) or (isinstance(value, str) and value == "auto")):
        raise ValueError(
            f"{owner} direct_io must be True (write past the page cache, O_DIRECT), False (through the page "
            f"cache) or 'auto' (measure both on the checkpoint's file system and use the faster; the "
            f"default); got {value!r}."
        )
    return value


def measure(root: Path, io: ThreadPoolExecutor, staging: Staging) -> dict[str, float | None]:
    """GB/s of each way of writing over a file in ``root`` (see the module doc); ``o_direct`` is
    None where the file system refuses it. Leaves no file behind."""
    data = filler()
    files = {direct: root / f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}" for direct in (False, True)}
    seconds: dict[bool, float] = {}
    try:
        # Each way's file, untimed: the timed writes go over it, as saves go over recycled files.
        refused = not _probe(files[True], io, staging, True, data)[1]
        _probe(files[False], io, staging, False, data)
        for direct in (False, True, True, False) * (PROBE_FILES // 2):
            if direct and refused:
                continue
            took, _ = _probe(files[direct], io, staging, direct, data, over=True)
            seconds[direct] = min(took, seconds.get(direct, took))
    finally:
        for path in files.values():
            path.unlink(missing_ok=True)
    written = PROBE_BYTES / 1e9
    return {
        "page_cache": round(written / seconds[False], 3),
        "o_direct": None if refused else round(written / seconds[True], 3),
    }


def _probe(
    path: Path,
    io: ThreadPoolExecutor,
    staging: Staging,
    direct: bool,
    data: bytes,
    times: int = PROBE_BYTES // BUFFER_BYTES,
    *,
    over: bool = False,
) -> tuple[float, bool]:
    """Seconds to write ``data`` ``times`` over to ``path`` (a new file, or ``over`` the one there)
    and fsync it, and whether it went past the page cache; through the page cache its pages stay
    there, as a recycled file's do. The caller deletes the file."""
    started = time.perf_counter()
    writer = DurableWriter(path, io, staging, direct=direct, overwrite=over, keep_pages=True)
    try:
        for _ in range(times):
            writer.write(data)
        writer.finish()
        return time.perf_counter() - started, writer.direct
    except BaseException:
        writer.abort()
        raise


# One probe per file system, shared by the stores of this process while it is fresh: (rates, when).
_probed: dict[int, tuple[dict[str, float | None], float]] = {}
_probed_lock = threading.Lock()


def _way(direct: bool) -> str:
    return "o_direct" if direct else "page_cache"


def size_class(nbytes: int) -> int:
    """Files within a factor of two of each other share their saves' rates (the page cache's rate
    depends on how much is written at once)."""
    return max(nbytes, 1).bit_length()


class WriteMode:
    """A store's way of writing: forced by ``direct_io=True``/``False``, or measured ("auto"), per
    file by its size."""

    def __init__(self, owner: str, setting: Any) -> None:
        self.setting = check_direct_io(owner, setting)
        self.choice: Choice | None = None  # the last file's (before any: a file of a size not saved yet)
        self._probe: dict[str, float | None] = {}
        self._probed_at = 0.0
        # size class -> direct -> (bytes, seconds, when) of its last files
        self._saved: dict[int, dict[bool, deque[tuple[int, float, float]]]] = {}
        self._current: dict[int, bool] = {}  # size class -> the way its last file was written
        self._last_bytes: int | None = None
        self._recheck: threading.Thread | None = None
        self._file_bytes: dict[str, int] = {}  # each file's size at the last save: how its next one is written

    def for_part(self, stem: str, obj: Any) -> tuple[Choice, int]:
        """The way to write a save's file ``stem`` holding ``obj``, and the size it is chosen for:
        each file its own way, by its size: its size last time (``part_written``), or at its first
        save its tensors' bytes."""
        expected = self._file_bytes.get(stem)
        if expected is None:
            expected = tensor_bytes(obj)
        return self.for_file(expected), expected

    def part_written(self, stem: str, nbytes: int) -> None:
        """File ``stem`` of a save was ``nbytes``: its next save's way is chosen for that size."""
        self._file_bytes[stem] = nbytes

    def choose(self, root: Path, io: ThreadPoolExecutor, staging: Staging) -> Choice:
        """The way to write a file of a size not saved yet into ``root`` (an existing directory):
        made once, in ``prepare``, which measures (or learns that a way is forced)."""
        if self.choice is None:
            self.choice = self._first_choice(root, io, staging)
        return self.choice

    def _first_choice(self, root: Path, io: ThreadPoolExecutor, staging: Staging) -> Choice:
        if self.setting is False:
            return Choice(False, "direct_io=False")
        if self.setting is True:  # one block, to learn whether the file system takes O_DIRECT
            path = root / f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"
            try:
                _, direct = _probe(path, io, staging, True, bytes(ALIGN), 1)
            finally:
                path.unlink(missing_ok=True)
            return Choice(True, "direct_io=True") if direct else Choice(False, "O_DIRECT refused")
        device = root.stat().st_dev
        with _probed_lock:
            known = _probed.get(device)
        if known is not None and time.monotonic() - known[1] < RECHECK_SECONDS:
            self._probe, self._probed_at = known
        else:
            self._run_probe(device, root, io, staging)
        return self._decide(None)

    def _run_probe(self, device: int, root: Path, io: ThreadPoolExecutor, staging: Staging) -> None:
        self._probe, self._probed_at = measure(root, io, staging), time.monotonic()
        with _probed_lock:
            _probed[device] = (self._probe, self._probed_at)

    def for_file(self, nbytes: int) -> Choice:
        """The way to write a file of about ``nbytes`` (after ``choose``)."""
        assert self.choice is not None, "choose() first (CheckpointStore.prepare)"
        if self.setting == "auto" and self._probe.get("o_direct") is not None:
            self._last_bytes = nbytes
            self.choice = self._decide(nbytes)
        return self.choice

    def after_write(self, direct: bool, nbytes: int, seconds: float, rated: bool = True) -> None:
        """A file of ``nbytes`` was written in ``seconds`` (serializing included) the ``direct``
        way: from a size where fixed costs no longer hide the rate on, and where ``rated`` (written
        over a kept file, as the probe and a running store's saves write), it counts ("auto" only)."""
        if self.setting != "auto":
            return
        size = size_class(nbytes)
        self._current[size] = direct  # the way in use at this size, which keeps its place within noise
        if rated and nbytes >= RATED_BYTES and seconds > 0:
            ways = self._saved.setdefault(size, {})
            ways.setdefault(direct, deque(maxlen=SAVES_KEPT)).append((nbytes, seconds, time.monotonic()))

    @staticmethod
    def rated(overwrite: bool, direct: bool, cached: bool) -> bool:
        """Whether a save's file counts for its way's rate (``after_write``): where it wrote over a
        file as saves do once running: with O_DIRECT over its blocks, through the page cache over
        its cached pages too. A new file's blocks and fresh pages are a one-off, not the way's rate."""
        return overwrite and (direct or cached)

    def _decide(self, nbytes: int | None) -> Choice:
        """The way for a file of ``nbytes`` (None: of a size not known yet, as in ``prepare``).

        Files of its size (the last ``SAVES_KEPT`` of each way, at most ``RECHECK_SECONDS`` old)
        written both ways: the faster of them. Written one way only: the other way is tried for one
        file when there are ``TRY_AFTER`` of these files or more and its probe is faster than the
        fastest of them by ``TRY_MARGIN`` (a probe's
        small files may flatter a way that large ones do not: the saves are what counts). None yet:
        the faster probe. A way in use keeps its place unless the other is faster by
        ``SWITCH_MARGIN``, so that noise does not flip it back and forth.

        Why the fastest file, for a try: one slow save is what a busy host gives now and then, and
        a try costs what it may not win back (``TRY_MARGIN``). A way that has become slow is slow
        in every file. Here a 384 MB save through the page cache took 0.255 s once among saves of
        0.12 s, which brought its two files and the two before them to 2.1 GB/s together, below
        ``O_DIRECT``'s probe of 3.4 GB/s over 1.5: each of two trainers tried ``O_DIRECT`` once,
        and one of them paid 1.1 s for it.
        """
        size = None if nbytes is None else size_class(nbytes)
        now = time.monotonic()
        saved, best, counted = {}, {}, {}
        for direct, files in self._saved.get(size, {}).items() if size is not None else ():
            fresh = [(n, seconds) for n, seconds, at in files if now - at < RECHECK_SECONDS]
            if fresh:
                saved[direct] = round(sum(n for n, _ in fresh) / sum(s for _, s in fresh) / 1e9, 3)
                best[direct] = max(n / s for n, s in fresh) / 1e9
                counted[direct] = len(fresh)
        rates = {"probe": self._probe, "saves": {_way(d): saved.get(d) for d in (False, True)}}
        probe_page, probe_direct = self._probe["page_cache"], self._probe["o_direct"]
        if probe_direct is None:
            return Choice(False, "O_DIRECT refused", rates)
        assert probe_page is not None
        current = None if size is None else self._current.get(size)
        if current is None:
            return Choice(probe_direct > probe_page, "measurement", rates)
        other = not current
        if other in saved and current in saved:
            return Choice(other if saved[other] > saved[current] * SWITCH_MARGIN else current, "saves", rates)
        theirs = probe_direct if other else probe_page
        if current in saved:
            if counted[current] >= TRY_AFTER and theirs > best[current] * TRY_MARGIN:
                return Choice(other, "trying the other way", rates)
            return Choice(current, "saves", rates)
        mine = probe_page if other else probe_direct
        return Choice(other if theirs > mine * SWITCH_MARGIN else current, "measurement", rates)

    def recheck_if_due(self, root: Path, io: ThreadPoolExecutor, staging: Staging, saving: threading.Lock) -> None:
        """After a save: probe again on a thread of its own when the probe is ``RECHECK_SECONDS``
        old ("auto" only); the next save decides with what it finds."""
        if self.setting != "auto" or self.choice is None or time.monotonic() - self._probed_at < RECHECK_SECONDS:
            return
        if self._recheck is not None and self._recheck.is_alive():
            return
        self._probed_at = time.monotonic()  # due again only after another period, whatever happens

        def recheck() -> None:
            try:
                with saving:  # the staging buffers and the I/O thread are the saves'
                    self._run_probe(root.stat().st_dev, root, io, staging)
                    self.choice = self._decide(self._last_bytes)
            except Exception:  # a failed probe (a full disk) changes nothing; the saves will say more
                pass

        self._recheck = threading.Thread(target=recheck, name="trainfsm-ckpt-probe", daemon=True)
        self._recheck.start()

    def close(self) -> None:
        if self._recheck is not None:
            self._recheck.join()
            self._recheck = None


activity.name(measure, "measuring the checkpoint disk's write rates (page cache, O_DIRECT)")
