"""This rank's place in its data (``DataCursor``): the epoch, the micro-batches drawn in it, the
iterator, and what the data ledger records of them (fingerprints of the batch after each save,
after each resume and of each epoch's first). How a position is found again is
``trainfsm.data_state``; where it stands in each epoch's order, at any world size,
``trainfsm.data_order``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import torch

from trainfsm import activity, data_order, rng
from trainfsm.data_state import Resumed, capture, choose, close_iterator, epoch_start, resume, set_epoch

#: The longest EXIT waits for the batch after an exiting save (``DataCursor.fingerprint_at_exit``);
#: part of the deadline's ``EXIT_SECONDS``.
EXIT_DRAW_SECONDS: Final = 1.0


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


def fingerprint(batch: Any) -> str:
    """A short hash of a batch's contents (tensors' bytes, other leaves' ``repr``, in a fixed order):
    the same batch gives the same fingerprint in any process. Used once per save, per resume and
    per epoch (its first batch), never per step."""
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
        self._resume: tuple[str, dict[str, Any], dict[str, Any] | None] | None = None
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

    def resume_later(self, mode: str, saved: dict[str, Any], rng_state: dict[str, Any] | None) -> None:
        """Have ``start`` position the iterator as ``saved`` says, then restore ``rng_state``.
        ``saved`` may be another world size's (``data_order.other_size``): every old rank's
        position, ``reshard`` and whose random streams ``rng_state`` are."""
        self._resume = (mode, saved, rng_state)

    def start(self) -> Resumed | None:
        """RESTORE's last work: the iterator, positioned when a checkpoint said where (returned,
        for the trail), else fresh. Random states are back before it exists, so a shuffling
        loader draws the order it drew before."""
        if self._resume is None:
            self.iterator = self._new_iterator()
            self.fingerprint_next("epoch", None)  # the data ledger names where a resumed loader really began
            return None
        mode, saved, rng_state = self._resume
        sizes: dict[str, Any] = {"from_world_size": None, "global": saved.get("global"), "exact": True}
        sizes.update(approximate=None, rng="this rank's own")
        why = None
        if "resize" in saved:
            sizes.update(rng=saved["rng_how"])
            mode, why, saved = self._continuation(mode, saved["resize"], rng_state, saved["reshard"], sizes)
        elif (rebatched := self._rebatched(saved)) is not None:  # another per-rank batch: a position, not a count
            mode, why, saved = self._continuation(mode, [saved], rng_state, "exact", sizes, rebatched)
        elif self.layout is not None:
            sizes["from_world_size"] = self.layout.world_size
        resumed = resume(self.loader, mode, saved)  # type: ignore[arg-type]
        self.iterator, self.batches, self.epoch_rng = resumed.iterator, resumed.batches, resumed.epoch_rng
        if rng_state is not None:
            rng.restore(rng_state)
        if resumed.mode == "none":  # a fresh pass: the position was not continued (asked for, or not saved)
            sizes.update(exact=False, approximate=sizes["approximate"] or resumed.why)
            why = None
        return dataclasses.replace(resumed, why=why or resumed.why, sizes=sizes)

    def _continuation(
        self,
        mode: str,
        old: list[dict[str, Any]],
        rng_state: dict[str, Any] | None,
        reshard: str,
        sizes: dict[str, Any],
        rebatched: int | None = None,
    ) -> tuple[str, str | None, dict[str, Any]]:
        """The mode (and why, when this chose it) and the per-rank position that continue ``old``
        (every old rank's position) at this world size (``trainfsm.data_order``); the trail's
        fields go into ``sizes``. A DataReshardError when that is not exact and ``reshard`` is
        "exact". ``rebatched``: ``old`` is this rank's own position at this world size, drawn with
        per-rank batches of that size (refused when not exact: no approximation is offered there)."""
        layout = self.layout
        assert layout is not None
        continuation = data_order.continue_at(old, layout)
        sizes.update(from_world_size=len(old) if rebatched is None else layout.world_size, **continuation.as_event())
        change, held = f"another world size ({len(old)} -> {layout.world_size})", "is another rank's"
        if rebatched is not None:
            change, held = f"another per-rank batch size ({rebatched} -> {layout.batch_size})", "counts other batches"
        if not continuation.exact:
            if rebatched is not None:
                raise DataReshardError(
                    f"the checkpoint was saved with a per-rank batch size of {rebatched} and this run's is "
                    f"{layout.batch_size}; its data position cannot be continued with each sample trained once: "
                    f"{continuation.reason}. Resume with batch_size={rebatched}."
                )
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
                        f"{change}: the loader's saved state {held}, so this rank's share of the epoch so far is "
                        f"replayed"
                    ),
                )
            else:
                why = f"{change}: {why}"
        return mode, why, saved

    def _rebatched(self, saved: dict[str, Any]) -> int | None:
        """The per-rank batch size ``saved`` (one rank's position at this world size) was drawn with,
        where it differs from this run's: its micro-batch count then means other samples (the
        global batch kept by ``global_batch_size``, the accumulation changed with it)."""
        then = (saved.get("layout") or {}).get("batch_size")
        now = self.layout.batch_size if self.layout is not None else None
        return then if then is not None and now is not None and then != now else None

    def next(self) -> Any:
        """The next batch, into the next epoch when one ends; ``EXHAUSTED`` after ``max_epochs``."""
        if self.limit is None or self.batches < self.limit:  # past it: a resume of a run whose global batch differed
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
                if self.limit is None or self.batches < self.limit:
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
            epoch, batches, digest = self.epoch, None, None
        elif found:
            epoch, batches, digest = found[0][1], found[0][2], fingerprint(found[0][0])
        else:
            return
        # DEBUG: the trail's, not the console's; EXIT's ``exit`` event writes it at once.
        self.log.debug(
            "batch_fingerprint", after="save", from_step=step, epoch=epoch, batches=batches, fingerprint=digest
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
