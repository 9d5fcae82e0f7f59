"""Restoring in RESTORE: which checkpoint to load, the ranks' agreement that it is intact, and
putting its state back into the trainer.

``load="latest"`` tries rank 0's list of checkpoints, newest first (``CheckpointStore.candidates``),
and skips one that any rank finds incomplete or corrupt; a named checkpoint must be intact. Every
rank verifies its share and one all_gather makes the verdict common, so that all skip it or all load
it. A full checkpoint is checked against the model's keys and shapes and goes through
``trainer.load_state_dict``; a sharded one is read in place with DCP, on any world size. Each rank
then resumes its own random streams and data position (rank 0's on a different world size).

A checkpoint trainloop wrote (``trainfsm.checkpoint.trainloop``) loads through the same
``trainer.load_state_dict``; it has no manifest to verify and no random state or data position.
Directories trainfsm did not write are reported once (``checkpoint_foreign``), and RESTORE refuses
to train towards one this run could save over (``refuse_foreign_ahead``): before the first step,
where stopping loses nothing, rather than at that save.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainfsm import activity, collectives, data_order
from trainfsm.checkpoint.io import hex_of, tensor_bytes
from trainfsm.checkpoint.manifest import MANIFEST
from trainfsm.checkpoint.store import TRAINFSM, TRAINLOOP, CheckpointError, CheckpointStore, foreign_in_the_way
from trainfsm.checkpoint.trainloop import is_trainloop
from trainfsm.checkpoint.trainloop import load as load_trainloop
from trainfsm.trail.console import notice

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer


def open_store(trainer: BaseTrainer, root: Path, *, direct_io: bool | str, checksum: str) -> CheckpointStore:
    """The store under ``root``; rank 0 (which writes) puts interrupted saves' complete checkpoints
    in place, removes their other leftovers, and prepares the writer now, not in the first save's
    step: its threads and buffers, the serializer's imports, and the way it writes (measured on
    this disk, or forced), which the trail records."""
    store = CheckpointStore(root, direct_io=direct_io, checksum=checksum)
    log = trainer.events
    if trainer.rank == 0:
        # A save killed once its checkpoint was complete is finished, not thrown away: of a step
        # saved again, the new copy is the one the run meant to keep.
        completed = store.complete_interrupted()
        if completed:
            log.warning("checkpoint_tmp_completed", names=completed)
        removed = store.remove_leftovers()
        if removed:
            log.warning("checkpoint_tmp_removed", names=removed)
        foreign = store.foreign()
        if foreign:
            log.warning("checkpoint_foreign", found={c.path.name: c.written_by or "unknown" for c in foreign})
        seconds = store.prepare()
        assert store.mode is not None
        log.debug("checkpoint_store_ready", seconds=round(seconds, 6), **store.mode.fields())
    return store


def reserve_room(trainer: BaseTrainer, store: CheckpointStore, model_state: dict[str, Any], copies: int) -> None:
    """Rank 0, saving whole checkpoints: have the store take, now, the room of ``copies`` files as
    large as a save's model and optimizer state (``model_state``, its global shapes: what a full
    save gathers; ``optimizer_state_bytes``), less what the checkpoints on disk and the files kept
    for recycling hold already (``CheckpointStore.reserve``: written on a fresh start, so that the
    saves before the first prune write over allocated blocks as later ones do; allocated without
    writing on a restart). The trail says how much and how long (``checkpoint_room_reserved``). An
    exit signal stops the writing where it is: the run leaves at RESTORE's end, and EXIT deletes
    what was written (``complete=False``)."""
    started = time.perf_counter()
    sizes = {"model": tensor_bytes(model_state), "training_state": optimizer_state_bytes(trainer)}
    try:
        reserved = store.reserve(sizes, copies, stop=lambda: trainer.exit_pending)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise CheckpointError(
            f"{store.root} has no room for this run's checkpoints: reserving, in RESTORE, the room of the "
            f"{copies} checkpoints it holds at once ({copies * sum(sizes.values()) / 1e6:.0f} MB, the checkpoints "
            f"and kept files already there counted) failed ({error}). Free space there, or give "
            f"CheckpointingHook(path=...) a directory on a disk with that much room (keep_previous=0 needs the "
            f"least: two checkpoints, as a save writes the new one beside the last)."
        ) from error
    if reserved.bytes or reserved.allocated or not reserved.complete:
        trainer.events.debug(
            "checkpoint_room_reserved",
            bytes=reserved.bytes,
            allocated=reserved.allocated,
            seconds=round(time.perf_counter() - started, 6),
            complete=reserved.complete,
        )


def optimizer_state_bytes(trainer: BaseTrainer) -> int:
    """The bytes of the optimizer's state in a save: what it holds (read from ``optimizer.state``,
    not ``state_dict()``, which ``ZeroRedundancyOptimizer`` refuses before a consolidation), or,
    where its state appears only at its first step (momentum, Adam), an estimate: the bytes a
    toy optimizer of its class and settings keeps per byte of a toy parameter after one step,
    times the bytes of its parameters. The toy is stepped, never the trainer's optimizer; where
    the toy cannot be made (an optimizer that needs more than its parameters and settings), 0."""
    optimizer = getattr(trainer, "optimizer", None)
    state = getattr(optimizer, "state", None)
    if optimizer is None or state is None:
        return 0
    if state:
        return tensor_bytes(list(state.values()))
    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    held = sum(p.numel() * p.element_size() for p in params if isinstance(p, torch.Tensor))
    return int(held * _state_per_byte(type(optimizer), dict(getattr(optimizer, "defaults", {}))))


def _state_per_byte(kind: type, defaults: dict[str, Any]) -> float:
    import inspect
    import warnings

    toy = torch.zeros(1024, requires_grad=True)
    try:
        # Only the settings its constructor takes: some classes keep more in ``defaults`` than they
        # take (AdamW's ``decoupled_weight_decay``).
        taken = inspect.signature(kind).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
            defaults = {key: value for key, value in defaults.items() if key in taken}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = kind([toy], **defaults)
            toy.grad = torch.zeros_like(toy)
            optimizer.step()
    except Exception:  # any optimizer of the user's: no estimate, no reservation
        return 0.0
    state = getattr(optimizer, "state", {})
    return tensor_bytes(list(state.values())) / (toy.numel() * toy.element_size())


def model_shapes(trainer: BaseTrainer) -> dict[str, Any]:
    """The model state's keys and (global) shapes, on every rank alike: a sharded view needs no
    gather, and a full one with cpu_offload=True is empty on every rank but 0."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainfsm.checkpoint.sharded import sharded_view

    return get_model_state_dict(trainer.model, options=sharded_view(trainer.state_dict_options))  # type: ignore[arg-type]


def restore(
    trainer: BaseTrainer,
    store: CheckpointStore,
    load: Path | str,
    data_resume: str,
    current: dict[str, Any],
    data_reshard: str = "exact",
) -> Path | None:
    """Load ``load`` (``"latest"``, or a path, relative ones first under the store) into ``trainer``;
    the path loaded, or None when ``"latest"`` found nothing that loads."""
    if load == "latest":
        # Rank 0's list: every rank tries the same checkpoints in the same order.
        names: list[str] = collectives.from_rank0([c.path.name for c in store.candidates()])
        for name in names:
            path = store.root / name
            try:
                manifest, parts = _verified(trainer, path)
            except CheckpointError as exc:
                trainer.events.warning("checkpoint_skipped", path=str(path), reason=str(exc))
                continue
            _apply(trainer, path, manifest, parts, current, data_resume, data_reshard)
            return path
        return None
    path = Path(load)
    if not path.is_absolute() and (store.root / path).exists():  # "1000" means checkpoints/1000
        path = store.root / path
        target = store.target(str(load)) if path.is_file() else None
        if target is not None:  # "best" where pointers are one-line files (no symlinks there)
            path = store.root / target
    manifest, parts = _verified(trainer, path)
    _apply(trainer, path, manifest, parts, current, data_resume, data_reshard)
    if trainer.rank == 0:
        _warn_if_older(trainer, store, path, load)
    return path


def _warn_if_older(trainer: BaseTrainer, store: CheckpointStore, path: Path, load: Path | str) -> None:
    """A named checkpoint (``load="best"``, a path) loaded while the store holds a newer complete one:
    left in a script that is requeued, every preemption would train the steps since it again. The
    run's first save abandons the newer ones (``trainfsm.checkpoint.lineage``)."""
    newer = [c for c in store.candidates() if c.step > trainer.step]
    if not newer:
        return
    newest = newer[0]
    trainer.events.warning(
        "checkpoint_not_newest",
        path=str(path),
        from_step=trainer.step,
        newest=str(newest.path),
        newest_step=newest.step,
    )
    notice(
        trainer.logger,
        f"load={str(load)!r} resumed from step {trainer.step}, but {newest.path} (step {newest.step}) is newer: "
        f"the {newest.step - trainer.step} steps since are trained again. Once this run saves, the newer "
        'checkpoints are abandoned: load="latest" resumes from this run\'s, and pruning deletes the newer ones '
        f'not kept. A script that is requeued after a preemption should resume with load="latest".',
    )


def start_timeline(trainer: BaseTrainer, store: CheckpointStore, load: Path | str | None) -> None:
    """Rank 0 (which writes the manifests): tell the store the step this run's timeline starts
    from, which its saves record; once it saves, the checkpoints written before past that step are
    abandoned (``trainfsm.checkpoint.lineage``). A run told where to start (``load=`` a name or a
    path, or None: step 0) abandons the newer ones; ``load="latest"`` none, not even a newer one it
    skipped as corrupt: a read that failed once (a flaky file system) may not fail at the next start,
    and must not cost the checkpoint."""
    if trainer.rank != 0:
        return
    start = trainer.step
    if load == "latest":
        newest = next(store.candidates(), None)
        start = max(start, newest.step if newest is not None else 0)
    elif load is None:
        newer = [c for c in store.candidates() if c.ours]
        if newer:
            notice(
                trainer.logger,
                f"load=None starts from step 0, but {store.root} holds checkpoints up to step {newer[0].step}: once "
                f'this run saves, they are abandoned: load="latest" no longer resumes from them (they stay on disk, '
                f'never pruned: delete them when no longer needed). To resume from them, use load="latest".',
            )
    store.resumed_from(start)


def refuse_foreign_ahead(trainer: BaseTrainer, store: CheckpointStore) -> None:
    """Raise on every rank when a directory trainfsm did not write has a step this run may still
    save (after the step it starts from, up to ``max_steps``): a save never replaces it, so the run
    would fail there, with its steps since the last save lost."""
    ahead = collectives.from_rank0(
        [(str(c.path), c.step) for c in store.foreign() if trainer.step < c.step <= trainer.max_steps]
        if trainer.rank == 0
        else None
    )
    if ahead:
        raise CheckpointError(" ".join(foreign_in_the_way(Path(p), step) for p, step in ahead))


def _verified(trainer: BaseTrainer, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and ``.pt`` parts of ``path`` once every rank found its share intact; otherwise
    the same CheckpointError on every rank (so that all skip it, or all load it).

    Each rank checks its own share of a sharded checkpoint (``verify(share=...)``) and every file
    of a full one; a part that another rank checks may be loaded before its verdict arrives, which
    is safe (``weights_only=True``) and is thrown away if that verdict is no.
    """
    rank, world = trainer.rank, trainer.world_size
    manifest: dict[str, Any] = {}
    parts: dict[str, Any] = {}
    error: str | None = None
    try:
        if is_trainloop(path):  # nothing to verify: no manifest, no checksums
            manifest, parts = {"written_by": TRAINLOOP}, load_trainloop(path)
        else:
            manifest = CheckpointStore.verify(path, share=(rank, world))
            parts = CheckpointStore.load(path, manifest)
    except CheckpointError as exc:
        error = str(exc)
    if world > 1:
        found = collectives.gather_objects({"error": error})
        error = next((f"rank {r}: {e['error']}" for r, e in enumerate(found) if e["error"] is not None), None)
    if error is not None:
        raise CheckpointError(error)
    return manifest, parts


def _apply(
    trainer: BaseTrainer,
    path: Path,
    manifest: dict[str, Any],
    parts: dict[str, Any],
    current: dict[str, Any],
    data_resume: str,
    data_reshard: str = "exact",
) -> None:
    written_by = manifest.get("written_by", TRAINFSM)
    if written_by == TRAINLOOP:
        state = parts  # already the state: model, training state's entries, hook states
    else:
        state = {**parts.get("model", {}), **parts.get("training_state", {}), **parts.get("hooks", {})}
    ranks = state.pop("ranks", None)
    if ranks and len(ranks) == trainer.world_size:  # each rank resumes its own random streams and data
        state["rank_state"] = ranks[trainer.rank]
    elif ranks:  # another world size: the data position is continued from every old rank's
        state["rank_state"] = data_order.other_size(ranks, trainer.rank, data_reshard)
    sharded = bool(manifest.get("sharded"))
    if sharded:
        _load_sharded(trainer, path, state, current, data_resume)
    else:
        check_fits(path, current, state["model"])
        trainer.load_state_dict(state, data_resume=data_resume)
    trainer.events.info(
        "checkpoint_loaded",
        path=str(path),
        from_step=trainer.step,
        sharded=sharded,
        format=written_by,
        checksum=manifest_checksum(path, manifest) if written_by == TRAINFSM else None,
        **({"saved_world_size": manifest.get("world_size")} if sharded else {}),
    )
    if trainer.rank == 0 and written_by == TRAINLOOP:
        notice(
            trainer.logger,
            f"resumed from trainloop's checkpoint {trainer.step} ({path}): model, optimizer, scheduler and step "
            f"as trainloop saved them; trainloop saves no random state or data position, so the data loader "
            f"starts a fresh pass (its first batches again) and random numbers come from the script's seed",
        )
    elif trainer.rank == 0:
        notice(trainer.logger, f"resumed from checkpoint {trainer.step} ({path})")


def manifest_checksum(path: Path, manifest: dict[str, Any]) -> str | None:
    """The checksum ``checkpoint_saved`` recorded for this checkpoint (its manifest's, in the
    manifest's own algorithm): the data ledger ties a resume to the save it came from."""
    try:
        return hex_of(str(manifest.get("checksum", "sha256")), (path / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None


def _load_sharded(
    trainer: BaseTrainer, path: Path, state: dict[str, Any], current: dict[str, Any], data_resume: str
) -> None:
    """Model and optimizer in place with DCP (each rank reads what its shards need, whatever the
    world size that saved them), then the rest through ``trainer.load_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainfsm.checkpoint import sharded
    from trainfsm.torch_workarounds import capture_model_and_optimizer

    directory = path / sharded.SUBDIR
    metadata = sharded.read_metadata(directory)
    check_fits(path, current, sharded.saved_shapes(metadata))
    view = sharded.sharded_view(trainer.state_dict_options)
    if any(key.startswith("optimizer.state.") for key in metadata.state_dict_metadata):
        # The optimizer's state exists only after a step; get_state_dict creates it (zeros) so that
        # DCP has tensors to read into: once, here, not at each save.
        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer, options=view)  # type: ignore[arg-type]
    else:  # saved without optimizer state: so it stays, with no zero-gradient step
        model_state, optim_state = capture_model_and_optimizer(trainer.model, trainer.optimizer, view)
    target = {"model": model_state, "optimizer": optim_state}
    sharded.load(target, directory)
    trainer.load_state_dict({**state, **target}, options=view, data_resume=data_resume)


def check_fits(path: Path, current: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse a model state whose keys or shapes differ from the model's, naming them all.
    ``saved`` holds tensors, or (a sharded checkpoint's metadata) their global ``torch.Size``.

    Checked before anything is loaded, so a mismatch changes nothing: torch would otherwise
    report only the first problem it meets, or fail on the optimizer's state first.
    """
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    shapes = sorted(
        f"{key} (checkpoint {tuple(saved_shape)}, model {tuple(model_shape)})"
        for key in set(current) & set(saved)
        if (model_shape := _shape(current[key])) is not None
        and (saved_shape := _shape(saved[key])) is not None
        and model_shape != saved_shape
    )
    problems = [
        f"{label}: {', '.join(items)}"
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", shapes))
        if items
    ]
    if problems:
        raise CheckpointError(
            f"{path} does not fit the model ({'; '.join(problems)}). Resume with the model it was saved "
            f"from, or load it with load=None and copy the weights you want yourself."
        )


def _shape(value: Any) -> torch.Size | None:
    if isinstance(value, torch.Tensor):
        return value.shape  # a DTensor's is the global shape
    return value if isinstance(value, torch.Size) else None


activity.name(restore, "a checkpoint load")
