"""Where the data iterator is, so a resumed run draws exactly the batches the interrupted one
would have drawn, in a time that does not grow with how far into the epoch it was.

Four ways to get back there (``CheckpointingHook(data_resume=...)``):

- ``"state"``: the loader has ``state_dict()`` / ``load_state_dict()`` (torchdata's
  ``StatefulDataLoader``); its own state is saved and loaded.
- ``"sampler"``: a ``torch.utils.data.DataLoader`` over a map-style dataset. The indices of the
  batches already drawn are skipped at its (batch) sampler, so no sample is loaded for them: the
  cost is that of drawing indices (~1 s per 10 M here), not of loading data.
- ``"skip"``: any re-iterable. The batches already drawn are drawn again and dropped (replayed):
  every one is loaded, so the cost grows with the position.
- ``"none"``: start a fresh iterator; the run continues with different batches.

``"sampler"`` and ``"skip"`` both restore the random state *of the moment the epoch's iterator was
created* (the global generators, and the loader's and its sampler's own ``generator``), create the
iterator again (so a shuffling loader draws the same permutation), position it, and then the
checkpoint's own random state is restored.

``"auto"`` (the default) picks the fastest mode that is exact for the loader (``choose``): a
``DataLoader`` with ``num_workers > 0`` replays, because a worker's random state (random
augmentation in ``__getitem__``) depends on every sample that worker loaded before, and a plain
``DataLoader`` cannot restore it; ``data_resume="sampler"`` skips anyway when ``__getitem__`` draws
no random numbers.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from trainfsm import activity, data_order, rng

MODES: Final = ("auto", "state", "sampler", "skip", "none")

#: The longest EXIT waits for the batch after an exiting save (``DataCursor.fingerprint_at_exit``);
#: part of the deadline's ``EXIT_SECONDS``.
EXIT_DRAW_SECONDS: Final = 1.0


def has_state(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _map_style(loader: Any) -> bool:
    """A ``DataLoader`` that draws indices from a (batch) sampler and iterates as torch's does."""
    from torch.utils.data import DataLoader, IterableDataset

    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and type(loader).__iter__ is DataLoader.__iter__
    )


def choose(mode: str, loader: Any) -> tuple[str, str]:
    """The mode resume uses for ``loader`` and why (recorded in the trail as ``data_resumed``)."""
    if mode == "auto":
        if has_state(loader):
            return "state", "the loader saves its own position (state_dict)"
        if _map_style(loader):
            if loader.num_workers == 0:
                return "sampler", "map-style DataLoader: the used indices are skipped at its sampler, nothing is loaded"
            return "skip", (
                f"DataLoader with num_workers={loader.num_workers}: a worker's random state depends on the samples it "
                "loaded before, so the used batches are replayed to stay exact; data_resume='sampler' skips them "
                "without loading, exact when __getitem__ draws no random numbers"
            )
        return "skip", (
            f"{type(loader).__name__} is not a map-style DataLoader: only replaying the used batches finds the "
            "position; a stateful loader (torchdata StatefulDataLoader) resumes without replay"
        )
    if mode == "state" and not has_state(loader):
        raise ValueError(
            f'data_resume="state" needs a data loader with state_dict()/load_state_dict() '
            f'(e.g. torchdata StatefulDataLoader); {type(loader).__name__} has none. Use "auto".'
        )
    if mode == "sampler" and not _map_style(loader):
        raise ValueError(
            f'data_resume="sampler" needs a torch.utils.data.DataLoader over a map-style dataset (one with '
            f'__getitem__ and __len__); {type(loader).__name__} is not one. Use "skip" or "auto".'
        )
    return mode, "asked for (data_resume)"


def _generators(loader: Any) -> list[torch.Generator]:
    """The loader's own random generators (``DataLoader(generator=...)``, a sampler's): a shuffling
    loader given one draws its order from it, not from the global generator."""
    found: list[torch.Generator] = []
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def epoch_start(loader: Any) -> dict[str, Any]:
    """The random state that decides an epoch's order, taken just before its iterator is made."""
    return {**rng.capture(), "generators": [g.get_state() for g in _generators(loader)]}


def _restore_epoch_start(loader: Any, state: dict[str, Any]) -> None:
    rng.restore(state)
    saved = state.get("generators") or []
    generators = _generators(loader)
    if len(saved) == len(generators):
        for generator, generator_state in zip(generators, saved, strict=True):
            generator.set_state(generator_state)


def capture(
    loader: Any,
    epoch: int,
    batches: int,
    epoch_rng: dict[str, Any] | None,
    layout: data_order.Layout | None = None,
    layout_event: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's data position, for the checkpoint: its own (epoch, micro-batches drawn, the
    random state that decided the epoch's order, the loader's state) and, where the order is
    known, the global one (``trainfsm.data_order``) with the layout that maps one to the other."""
    exact = layout is not None and layout.exact
    return {
        "epoch": epoch,
        "batches": batches,
        "epoch_rng": epoch_rng,
        "loader": loader.state_dict() if has_state(loader) else None,
        "layout": layout_event,
        "global": {"epoch": epoch, "samples": layout.samples(batches)} if exact else None,  # type: ignore[union-attr]
    }


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a distributed sampler (or a loader that knows epochs) which epoch this is, and the
    dataset too when it has ``set_epoch`` of its own (an iterable dataset that shuffles by epoch)."""
    told: list[Any] = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        method = getattr(owner, "set_epoch", None)
        if callable(method):
            method(epoch)
            told.append(owner)
            break
    dataset = getattr(loader, "dataset", None)
    method = getattr(dataset, "set_epoch", None)
    if callable(method) and all(dataset is not owner for owner in told):
        method(epoch)


def _batches(indices: Iterator[Any], size: int, drop_last: bool) -> Iterator[list[Any]]:
    """What ``torch.utils.data.BatchSampler`` yields from ``indices``."""
    while batch := list(itertools.islice(indices, size)):
        if drop_last and len(batch) < size:
            return
        yield batch


def _consume(iterator: Iterator[Any], count: int) -> None:
    collections.deque(itertools.islice(iterator, count), maxlen=0)  # at C speed


class _Skipping:
    """The sampler's items less the first ``count``.

    Random draws happen when they would have in the uninterrupted run: ``iter(sampler)`` where the
    loader makes its iterator (a sampler may draw there), and the skip, which draws a shuffling
    sampler's seed at its first item, at once after the loader drew its workers' base seed
    (``start``), before the checkpoint's own random state is restored. Under torch's own
    ``BatchSampler`` the skip is of ``count x batch_size`` indices of its sampler, re-batched as it
    would: ~10x faster than drawing ``count`` batches through it (0.1 s per 100k batches of 16).
    """

    def __init__(self, sampler: Any, count: int) -> None:
        from torch.utils.data import BatchSampler

        self._sampler = sampler
        self._count = count
        self._batched = type(sampler) is BatchSampler
        # BatchSampler's own __iter__ is a generator: it would call iter(sampler.sampler) at its first batch.
        self._iterator: Iterator[Any] | None = None if self._batched else iter(sampler)
        self.started = False

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        if self._batched:
            size, drop_last = self._sampler.batch_size, self._sampler.drop_last
            indices = iter(self._sampler.sampler)
            _consume(indices, self._count * size)
            self._iterator = _batches(indices, size, drop_last)
        else:
            assert self._iterator is not None
            _consume(self._iterator, self._count)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if not self.started:
            self.start()
        return next(self._iterator)  # type: ignore[arg-type]


class _SkipFirst:
    """A loader's index sampler whose passes are ``_Skipping`` until one of them has skipped (a
    multi-worker loader asks for a pass twice as it starts, and uses the second); later passes
    (persistent workers reuse it) are the sampler's own."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler = sampler
        self.count = count
        self.latest: _Skipping | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.latest is not None and self.latest.started:
            return iter(self.sampler)
        self.latest = _Skipping(self.sampler, self.count)
        return self.latest

    def __len__(self) -> int:
        return len(self.sampler)


def _iter_skipping(loader: Any, count: int) -> Iterator[Any]:
    """``iter(loader)`` without the first ``count`` (> 0) batches, none of them loaded.

    The iterator reads the loader's index sampler when it is made (and a multi-worker one sends
    the first indices to its workers right then), so the sampler is swapped for that moment only;
    ``DataLoader`` forbids setting it, hence ``object.__setattr__``.
    """
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    original = getattr(loader, name)
    wrapper = _SkipFirst(original, count)
    object.__setattr__(loader, name, wrapper)
    try:
        iterator = iter(loader)
    finally:
        object.__setattr__(loader, name, original)
    if wrapper.latest is not None:
        wrapper.latest.start()  # a multi-worker loader has started it already, sending its first indices
    return iterator  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Resumed:
    """What ``resume`` did: the iterator, where it stands, and what it cost (for the trail)."""

    iterator: Iterator[Any]
    batches: int  # batches of the epoch already drawn, as the uninterrupted run counts them
    epoch_rng: dict[str, Any] | None
    mode: str
    why: str
    positioned: int  # batches skipped ("sampler") or replayed ("skip") to get there
    seconds: float
    sizes: dict[str, Any] | None = None  # the world sizes and global position (``DataCursor.start``)

    def as_event(self) -> dict[str, Any]:
        """The ``data_resumed`` event's fields (less ``epoch``): how, why, and what it cost."""
        return {
            "mode": self.mode,
            "why": self.why,
            "batches": self.batches,
            "positioned": self.positioned,
            "seconds": round(self.seconds, 6),
            **(self.sizes or {}),
        }


class EpochWarning(UserWarning):
    """The dataset's ``set_epoch`` cannot reach where it would matter."""


def warn_unreached_epochs(loader: Any) -> None:
    """A dataset with ``set_epoch`` (an iterable one that shuffles by epoch) is told each epoch
    in the training process; persistent loader workers keep the copy they were made with, so
    every epoch would repeat the first one's order there."""
    dataset = getattr(loader, "dataset", None)
    if (
        callable(getattr(dataset, "set_epoch", None))
        and getattr(loader, "persistent_workers", False)
        and getattr(loader, "num_workers", 0) > 0
    ):
        warnings.warn(
            f"{type(dataset).__name__}.set_epoch is called in the training process each epoch, but the loader's "
            f"persistent_workers keep the copies of the dataset they were made with, which never hear of it: "
            f"every epoch would draw the first one's order. Pass persistent_workers=False (workers are then made "
            f"anew each epoch from the told dataset), or have the dataset read the epoch from shared memory.",
            EpochWarning,
            stacklevel=2,
        )


class DataReshardError(RuntimeError):
    """A resume on another number of ranks cannot train each sample once, and the user did not
    accept an approximation."""


def resume(loader: Iterable[Any], mode: str, saved: dict[str, Any]) -> Resumed:
    """A new iterator positioned as ``saved`` says."""
    started = time.perf_counter()
    mode, why = choose(mode, loader)
    set_epoch(loader, saved["epoch"])
    target = int(saved["batches"])
    epoch_rng = saved.get("epoch_rng")

    def done(iterator: Iterator[Any], batches: int, state: dict[str, Any] | None, positioned: int) -> Resumed:
        return Resumed(iterator, batches, state, mode, why, positioned, time.perf_counter() - started)

    if mode == "state" and saved.get("loader") is not None:
        loader.load_state_dict(saved["loader"])  # type: ignore[attr-defined]
        return done(iter(loader), target, epoch_rng, 0)
    if mode in ("sampler", "skip") and epoch_rng is not None:
        _restore_epoch_start(loader, epoch_rng)
        if mode == "sampler" and target > 0:
            return done(_iter_skipping(loader, target), target, epoch_rng, target)
        iterator = iter(loader)
        drawn = sum(1 for _ in itertools.islice(iterator, target))  # replayed: each batch loaded
        return done(iterator, drawn, epoch_rng, drawn)
    if mode != "none":
        mode, why = "none", f"the checkpoint has no data position for {mode!r} (saved with another data_resume)"
    state = epoch_start(loader)
    return done(iter(loader), 0, state, 0)


def close_iterator(iterator: Iterator[Any] | None, *, epoch_end: bool = False) -> None:
    """Close a data iterator: generators run their ``finally``; DataLoader workers shut down,
    except persistent ones at the end of an epoch (the loader reuses them for the next)."""
    if iterator is None or (epoch_end and getattr(iterator, "_persistent_workers", False)):
        return
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
        return
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def fingerprint(batch: Any) -> str:
    """A short hash of a batch's contents (tensors' bytes, other leaves' ``repr``, in a fixed order):
    the same batch gives the same fingerprint in any process. Used once per save and per resume."""
    hasher = hashlib.blake2b(digest_size=8)

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            hasher.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        elif isinstance(value, Mapping):
            for key in sorted(value, key=repr):
                hasher.update(repr(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            hasher.update(f"{type(value).__name__}{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            hasher.update(repr(value).encode())

    feed(batch)
    return hasher.hexdigest()


#: What ``DataCursor.next`` returns once ``max_epochs`` epochs of data are used up.
EXHAUSTED: Final = object()


class DataCursor:
    """This rank's place in its data: the epoch, the batches drawn in it, the random state that
    decided its order, and the iterator. ``trainer.epoch`` is the cursor's epoch; a checkpoint
    saves ``state()`` and RESTORE positions the iterator as a loaded one says (``resume_later``)."""

    def __init__(self) -> None:
        self.loader: Iterable[Any] | None = None
        self.max_epochs: int | None = None
        self.log: Any = None  # the trail's logger (an ``epoch`` event at each new epoch)
        self.layout: data_order.Layout | None = None
        self._layout_event: dict[str, Any] | None = None
        #: Micro-batches per epoch when the trainer ends epochs itself (``global_batch_size`` over a
        #: visible order: at the last full global batch); None: where the iterator ends.
        self.limit: int | None = None
        self.epoch = 0
        self.batches = 0  # drawn in this epoch
        self.epoch_rng: dict[str, Any] | None = None
        self.iterator: Iterator[Any] | None = None
        self._resume: tuple[str, dict[str, Any], dict[str, Any] | None, str] | None = None
        #: On another world size, when the position cannot be continued exactly: "exact" (an
        #: error) or "approximate" (``CheckpointingHook(data_reshard=...)``).
        self.reshard = "exact"
        self.saved = False  # state() was taken since the last fingerprint (``fingerprint_after_save``)
        self._pending: list[tuple[str, int | None]] = []  # fingerprints the next draw records
        self._drawing: threading.Thread | None = None  # ``fingerprint_at_exit``'s draw

    def attach(
        self, loader: Iterable[Any], max_epochs: int | None, log: Any, layout: data_order.Layout | None = None
    ) -> None:
        self.loader, self.max_epochs, self.log = loader, max_epochs, log
        warn_unreached_epochs(loader)
        self.layout = layout
        self._layout_event = layout.as_event() if layout is not None else None
        if layout is not None and layout.exact and layout.global_batch is not None:
            self.limit = layout.epoch_batches

    def state(self) -> dict[str, Any]:
        """This rank's data position (epoch, batches drawn, epoch random state, loader state)."""
        self.saved = True  # a checkpoint takes it: the batch after it gets a fingerprint
        return capture(self.loader, self.epoch, self.batches, self.epoch_rng, self.layout, self._layout_event)

    def resume_later(
        self,
        mode: str,
        saved: dict[str, Any],
        rng_state: dict[str, Any] | None,
        rng_how: str = "this rank's own",
    ) -> None:
        """Have ``start`` position the iterator as ``saved`` says, then restore ``rng_state``.
        ``saved`` may be ``{"resize": [every old rank's position]}`` (another world size):
        ``reshard`` says whether a position that cannot be continued exactly is an error."""
        self._resume = (mode, saved, rng_state, rng_how)

    def start(self) -> Resumed | None:
        """RESTORE's last work: the iterator, positioned when a checkpoint said where (returned,
        for the trail), else fresh. Random states are back before it exists, so a shuffling
        loader draws the order it drew before."""
        if self._resume is None:
            self.iterator = self._new_iterator()
            self.fingerprint_next("epoch", None)  # the data ledger names where a resumed loader really began
            return None
        mode, saved, rng_state, rng_how = self._resume
        sizes: dict[str, Any] = {"from_world_size": None, "global": saved.get("global"), "exact": True}
        why = None
        if "resize" in saved:
            mode, why, saved, sizes = self._continuation(mode, saved["resize"], rng_state, self.reshard)
        elif self.layout is not None:
            sizes["from_world_size"] = self.layout.world_size
        resumed = resume(self.loader, mode, saved)  # type: ignore[arg-type]
        self.iterator, self.batches, self.epoch_rng = resumed.iterator, resumed.batches, resumed.epoch_rng
        if rng_state is not None:
            rng.restore(rng_state)
        if resumed.mode == "none":  # a fresh pass: the position was not continued (asked for, or not saved)
            sizes = {**sizes, "exact": False, "approximate": sizes.get("approximate") or resumed.why}
        why = why if why is not None and resumed.mode != "none" else resumed.why
        return Resumed(**{**resumed.__dict__, "why": why, "sizes": {"approximate": None, **sizes, "rng": rng_how}})

    def _continuation(
        self, mode: str, old: list[dict[str, Any]], rng_state: dict[str, Any] | None, reshard: str
    ) -> tuple[str, str | None, dict[str, Any], dict[str, Any]]:
        """The mode (and why, when this chose it), the per-rank position that continue ``old``
        (every old rank's position) at this world size (``trainfsm.data_order``), and the trail's
        fields; a DataReshardError when that is not exact and ``reshard`` is "exact"."""
        layout = self.layout
        assert layout is not None
        continuation = data_order.continue_at(old, layout)
        sizes = {"from_world_size": len(old), **continuation.as_event(), "approximate": None}
        if not continuation.exact:
            if reshard != "approximate":
                raise DataReshardError(
                    f"the checkpoint was saved by {len(old)} rank(s) and this run has {layout.world_size}; its data "
                    f"position cannot be continued with each sample trained once: {continuation.reason}. Resume on "
                    f'{len(old)} rank(s), or pass CheckpointingHook(data_reshard="approximate") to continue '
                    f"anyway (the trail records it and `trainfsm audit` notes it)."
                )
            sizes["approximate"] = continuation.reason
        saved, why = continuation.data, None
        if continuation.global_position is not None:
            # Positioned by this rank's own micro-batch count at the new size: the old loader state
            # is another rank's at another size, and the epoch's random state this rank's own.
            saved = {**saved, "loader": None, "epoch_rng": rng_state or epoch_start(self.loader)}
            mode, why = choose(mode, self.loader)
            if mode == "state":  # replayed, so that a stateful loader's own state counts from the epoch's start
                mode, why = (
                    "skip",
                    (
                        f"another world size ({len(old)} -> {layout.world_size}): the loader's saved state is another "
                        f"rank's, so this rank's share of the epoch so far is replayed"
                    ),
                )
            else:
                why = f"another world size ({len(old)} -> {layout.world_size}): {why}"
        return mode, why, saved, sizes

    def next(self) -> Any:
        """The next batch, into the next epoch when one ends; ``EXHAUSTED`` after ``max_epochs``."""
        if self.batches != self.limit:  # None (no limit) is never equal
            try:
                batch = next(self.iterator)  # type: ignore[arg-type]
                self.batches += 1
                return batch
            except StopIteration:
                pass
        if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
            return EXHAUSTED  # the iterator stays open at its end: a checkpoint records that position
        close_iterator(self.iterator, epoch_end=True)
        self.epoch += 1
        self.iterator = self._new_iterator()
        try:
            batch = next(self.iterator)
            self.batches += 1
            self.log.debug("epoch", epoch=self.epoch, fingerprint=fingerprint(batch))  # its first batch's
            return batch
        except StopIteration:
            raise RuntimeError(
                "build_data_loader() returned an iterable that yields no batches when iterated again "
                f"(epoch {self.epoch}). Return a re-iterable such as a DataLoader or list, not a "
                "one-shot iterator or generator object, or make the iterable infinite."
            ) from None

    def close(self) -> None:
        iterator, self.iterator = self.iterator, None
        if self._drawing is not None and self._drawing.is_alive():
            return  # still in the exit's draw (``fingerprint_at_exit``): the process's end takes it
        close_iterator(iterator)

    def fingerprint_after_save(self, step: int) -> None:
        """Leaving CHECKPOINT for the next step: if a checkpoint took this rank's position, have the
        next draw fingerprinted (``fingerprint_next``)."""
        if self.saved:
            self.saved = False
            self.fingerprint_next("save", step)

    def fingerprint_at_exit(self, step: int, budget: float = EXIT_DRAW_SECONDS) -> None:
        """Leaving CHECKPOINT for EXIT after a save (preemption, the deadline, the last step): draw
        the batch a resume from it must draw first, fingerprint it, and drop it (it is not trained;
        the checkpoint holds the position before it). At an epoch's end that is the next epoch's
        first batch, from an iterator of its own (the cursor's epoch stays). The draw runs on a
        thread and is waited for ``budget`` seconds at most, so a stalled loader cannot hold the
        exit: the event then has no fingerprint, and the iterator is left as it is. A loader that
        fails here costs the trail this one fingerprint, never the run."""
        if not self.saved or self.iterator is None:
            return
        self.saved = False
        found: list[tuple[Any, int, int]] = []

        def draw() -> None:
            with contextlib.suppress(Exception):  # StopIteration at the data's end, or the loader's own failure
                if self.batches != self.limit:
                    with contextlib.suppress(StopIteration):
                        found.append((next(self.iterator), self.epoch, self.batches + 1))  # type: ignore[arg-type]
                        return
                if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                    return  # nothing follows: a resume from here ends the run
                set_epoch(self.loader, self.epoch + 1)
                iterator = iter(self.loader)  # type: ignore[arg-type]
                found.append((next(iterator), self.epoch + 1, 1))
                close_iterator(iterator)

        self._drawing = threading.Thread(target=draw, name="trainfsm-exit-draw", daemon=True)
        self._drawing.start()
        self._drawing.join(budget)
        if self._drawing.is_alive():  # abandoned: EXIT goes on; the ledger says this save is unchecked
            self.log.info(
                "batch_fingerprint", after="save", from_step=step, epoch=self.epoch, batches=None, fingerprint=None
            )
        elif found:
            batch, epoch, batches = found[0]
            self.log.info(
                "batch_fingerprint",
                after="save",
                from_step=step,
                epoch=epoch,
                batches=batches,
                fingerprint=fingerprint(batch),
            )

    def fingerprint_next(self, after: str, step: int | None) -> None:
        """Have the next draw record a ``batch_fingerprint`` (``after``: ``"save"``, ``"resume"``
        or ``"epoch"``; ``step``: the checkpoint's; None for an epoch's first batch).
        The data ledger compares the batch a resumed run draws first with the one the saving run
        drew after that save: equal unless the loader resumed elsewhere. Only that one draw pays:
        ``next`` is replaced on this instance and puts itself back."""
        self._pending.append((after, step))
        if len(self._pending) > 1:
            return

        def once() -> Any:
            del self.next  # the class's again
            batch = self.next()
            pending, self._pending = self._pending, []
            if batch is not EXHAUSTED:
                self._record(batch, pending, self.batches)
            return batch

        self.next = once  # type: ignore[method-assign]

    def _record(self, batch: Any, pending: list[tuple[str, int | None]], batches: int) -> None:
        digest = fingerprint(batch)
        for after, step in pending:
            if after == "epoch":  # the first epoch's first batch, as each new epoch's (``next``)
                self.log.debug("epoch", epoch=self.epoch, fingerprint=digest)
                continue
            # INFO: written at once, so a kill soon after does not lose it
            self.log.info(
                "batch_fingerprint", after=after, from_step=step, epoch=self.epoch, batches=batches, fingerprint=digest
            )

    def _new_iterator(self) -> Iterator[Any]:
        set_epoch(self.loader, self.epoch)
        # Once per epoch: the random state that decides this epoch's order, for exact resume.
        self.epoch_rng = epoch_start(self.loader)
        self.batches = 0
        return iter(self.loader)  # type: ignore[arg-type]


activity.name(DataCursor.next, "the data loader's next()")
activity.name(DataCursor.start, "positioning the data loader where the checkpoint left it")
