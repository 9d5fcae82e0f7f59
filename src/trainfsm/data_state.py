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
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch

from trainfsm import data_order, rng

MODES: Final = ("auto", "state", "sampler", "skip", "none")


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
