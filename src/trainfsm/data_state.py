"""Where the data iterator is, so a resumed run draws exactly the batches the interrupted one
would have drawn.

Three ways to get back there (``CheckpointingHook(data_resume=...)``):

- ``"state"``: the loader has ``state_dict()`` / ``load_state_dict()`` (torchdata's
  ``StatefulDataLoader`` style); its own state is saved and loaded.
- ``"skip"``: any re-iterable. The random state *at the moment the epoch's iterator was created* is
  saved with the number of batches drawn from it; resume restores that random state, creates the
  iterator (so a shuffling ``DataLoader`` draws the same permutation), draws and drops that many
  batches, and only then restores the random state of the checkpoint itself.
- ``"none"``: start a fresh iterator; the run continues with different batches.

``"auto"`` (the default) picks ``"state"`` when the loader has a state, else ``"skip"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Final

from trainfsm import rng

MODES: Final = ("auto", "state", "skip", "none")


def has_state(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def resolve_mode(mode: str, loader: Any) -> str:
    if mode == "auto":
        return "state" if has_state(loader) else "skip"
    if mode == "state" and not has_state(loader):
        raise ValueError(
            f'data_resume="state" needs a data loader with state_dict()/load_state_dict() '
            f'(e.g. torchdata StatefulDataLoader); {type(loader).__name__} has none. Use "skip" or "auto".'
        )
    return mode


def capture(loader: Any, epoch: int, batches: int, epoch_rng: dict[str, Any] | None) -> dict[str, Any]:
    """This rank's data position, for the checkpoint."""
    return {
        "epoch": epoch,
        "batches": batches,
        "epoch_rng": epoch_rng,
        "loader": loader.state_dict() if has_state(loader) else None,
    }


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a distributed sampler (or a loader that knows epochs) which epoch this is."""
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        method = getattr(owner, "set_epoch", None)
        if callable(method):
            method(epoch)
            return


def resume(loader: Iterable[Any], mode: str, saved: dict[str, Any]) -> tuple[Iterator[Any], int, Any]:
    """A new iterator positioned as ``saved`` says: (iterator, batches drawn, epoch random state)."""
    mode = resolve_mode(mode, loader)
    set_epoch(loader, saved["epoch"])
    if mode == "state" and saved.get("loader") is not None:
        loader.load_state_dict(saved["loader"])  # type: ignore[attr-defined]
        return iter(loader), saved["batches"], saved.get("epoch_rng")
    if mode == "skip" and saved.get("epoch_rng") is not None:
        rng.restore(saved["epoch_rng"])
        iterator = iter(loader)
        drawn = 0
        for _ in range(saved["batches"]):
            try:
                next(iterator)
            except StopIteration:
                break
            drawn += 1
        return iterator, drawn, saved["epoch_rng"]
    return iter(loader), 0, rng.capture()
