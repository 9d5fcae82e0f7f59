"""How a store writes its files: through the page cache (each 4 MiB's writeback started at once) or
past it (``O_DIRECT``), measured on the checkpoint's own file system and chosen, or forced.

Which way is faster depends on the storage, and on the same class of machine it changed: issue 14
measured the page cache twice as fast as ``O_DIRECT`` (1 GB in 1.6 s against 3.2 s); a few months
later, issue 35 measured the other way round (0.41 s per GB through the page cache, 0.27 s with
``O_DIRECT``). So with ``direct_io="auto"`` (the default) the store measures:

- **a probe, in RESTORE** (``CheckpointStore.prepare``): ``PROBE_FILES`` files of ``PROBE_BYTES``
  each way, in the order page cache, ``O_DIRECT``, ``O_DIRECT``, page cache (so that a disk
  speeding up or slowing down meanwhile favours neither), each written by the store's own writer
  (its staging buffers and I/O thread, a checksum on the way) and fsynced, then deleted. A way's
  rate is its bytes over its seconds, fsyncs included; the faster way is used. The probe files are
  named like a save's temporary directory, so a crash that leaves one is cleaned up in RESTORE;
- **a re-check, now and then**: once ``RECHECK_SECONDS`` have passed since the last measurement,
  the probe runs again on a thread of its own after a save, holding the store's save lock (a save
  that comes meanwhile waits for it); the store switches only when the other way is faster by more
  than ``SWITCH_MARGIN``, so noise does not flip it back and forth;
- **shared**: one measurement per file system (``st_dev``) and process, while it is fresh: the
  stores of a process on one disk do not probe it one after the other.

``direct_io=True`` or ``False`` forces a way and nothing is measured. Where the file system refuses
``O_DIRECT`` (tmpfs, some network or FUSE file systems: at ``open`` or at the first write) the store
writes through the page cache, and says so (``chosen_by="O_DIRECT refused"``). Each choice is in
the trail: ``checkpoint_store_ready`` and every ``checkpoint_saved`` carry ``direct_io``,
``chosen_by`` and ``rates`` (GB/s each way, as measured; null when forced).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from trainfsm import activity
from trainfsm.checkpoint.io import ALIGN, BUFFER_BYTES, DurableWriter, Staging

#: What ``direct_io`` may be: a forced way, or "auto" (measured).
SETTINGS: Final = (True, False, "auto")
# Per probe file: large enough that a file's fixed costs (open, the fsync's journal commit, a few ms
# here) do not hide the streaming rate, small enough to cost ~0.1 s. On this machine's disk 16 MiB
# files put the two ways within 7% of each other in a round where 200 MB files differed threefold.
PROBE_BYTES: Final = 32 << 20
PROBE_FILES: Final = 2  # per way: 128 MiB written in all, ~0.1 s on a disk of ~1.5 GB/s
RECHECK_SECONDS: Final = 600.0
SWITCH_MARGIN: Final = 1.10
PROBE_PREFIX: Final = ".tmp-probe-"  # store.TMP_PREFIX: leftovers of a crash are removed in RESTORE


@dataclass(frozen=True, slots=True)
class Choice:
    """The way a store writes now, why, and the rates it stands on (GB/s; None where refused)."""

    direct: bool
    chosen_by: str  # "measurement", "direct_io=True", "direct_io=False" or "O_DIRECT refused"
    rates: dict[str, float | None] | None = None  # {"page_cache": ..., "o_direct": ...}
    measured_at: float = 0.0  # time.monotonic() of the measurement

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
    """GB/s of each way of writing into ``root`` (see the module doc); ``o_direct`` is None where
    the file system refuses it. Leaves no file behind."""
    data = random.Random(0).randbytes(BUFFER_BYTES)  # not zeros, which some storage compresses
    seconds = {False: 0.0, True: 0.0}
    refused = False
    for direct in (False, True, True, False) * (PROBE_FILES // 2):
        if direct and refused:
            continue
        took, wrote_directly = _probe(root / f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}", io, staging, direct, data)
        seconds[direct] += took
        refused = refused or (direct and not wrote_directly)
    written = PROBE_FILES * PROBE_BYTES / 1e9
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
) -> tuple[float, bool]:
    """Seconds to write ``data`` ``times`` over to a new file and fsync it, and whether it went
    past the page cache."""
    started = time.perf_counter()
    writer = DurableWriter(path, io, staging, direct=direct)
    try:
        for _ in range(times):
            writer.write(data)
        writer.finish()
        return time.perf_counter() - started, writer.direct
    except BaseException:
        writer.abort()
        raise
    finally:
        path.unlink(missing_ok=True)


# One measurement per file system, shared by the stores of this process while it is fresh.
_measured: dict[int, Choice] = {}
_measured_lock = threading.Lock()


class WriteMode:
    """A store's way of writing: forced by ``direct_io=True``/``False``, or measured ("auto")."""

    def __init__(self, owner: str, setting: Any) -> None:
        self.setting = check_direct_io(owner, setting)
        self.choice: Choice | None = None
        self._recheck: threading.Thread | None = None

    @property
    def direct(self) -> bool:
        return self.choice is not None and self.choice.direct

    def choose(self, root: Path, io: ThreadPoolExecutor, staging: Staging) -> Choice:
        """The way to write into ``root`` (an existing directory): made once, in ``prepare``."""
        if self.choice is None:
            self.choice = self._first_choice(root, io, staging)
        return self.choice

    def _first_choice(self, root: Path, io: ThreadPoolExecutor, staging: Staging) -> Choice:
        if self.setting is False:
            return Choice(False, "direct_io=False")
        if self.setting is True:  # one block, to learn whether the file system takes O_DIRECT
            _, direct = _probe(root / f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}", io, staging, True, bytes(ALIGN), 1)
            return Choice(True, "direct_io=True") if direct else Choice(False, "O_DIRECT refused")
        device = root.stat().st_dev
        with _measured_lock:
            known = _measured.get(device)
        if known is not None and time.monotonic() - known.measured_at < RECHECK_SECONDS:
            return known
        return self._measure(device, root, io, staging, current=None)

    def _measure(
        self, device: int, root: Path, io: ThreadPoolExecutor, staging: Staging, current: Choice | None
    ) -> Choice:
        rates = measure(root, io, staging)
        page, direct = rates["page_cache"], rates["o_direct"]
        if direct is None:
            choice = Choice(False, "O_DIRECT refused", rates, time.monotonic())
        else:
            assert page is not None
            # The way in use keeps its place unless the other is clearly faster: noise must not flip it.
            margin = 1.0 if current is None else SWITCH_MARGIN
            if current is not None and current.direct:
                use_direct = not page > direct * margin
            else:
                use_direct = direct > page * margin
            choice = Choice(use_direct, "measurement", rates, time.monotonic())
        with _measured_lock:
            _measured[device] = choice
        return choice

    def recheck_if_due(self, root: Path, io: ThreadPoolExecutor, staging: Staging, saving: threading.Lock) -> None:
        """After a save: measure again on a thread of its own when the measurement is
        ``RECHECK_SECONDS`` old ("auto" only); the next save uses what it finds."""
        choice = self.choice
        if self.setting != "auto" or choice is None or time.monotonic() - choice.measured_at < RECHECK_SECONDS:
            return
        if self._recheck is not None and self._recheck.is_alive():
            return
        self.choice = replace(choice, measured_at=time.monotonic())  # due again only after another period

        def recheck() -> None:
            try:
                with saving:  # the staging buffers and the I/O thread are the saves'
                    self.choice = self._measure(root.stat().st_dev, root, io, staging, current=choice)
            except Exception:  # a failed probe (a full disk) changes nothing; the saves will say more
                pass

        self._recheck = threading.Thread(target=recheck, name="trainfsm-ckpt-probe", daemon=True)
        self._recheck.start()

    def close(self) -> None:
        if self._recheck is not None:
            self._recheck.join()
            self._recheck = None


activity.name(measure, "measuring the checkpoint disk's write rates (page cache, O_DIRECT)")
