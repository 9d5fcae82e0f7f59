"""Saving in CHECKPOINT: what goes into a checkpoint, which rank writes what, and where the ranks wait.

A full checkpoint: every rank builds ``trainer.state_dict()`` (FSDP gathers collectively), the ranks
share their random streams and data positions (one all_gather), and rank 0 writes model.pt,
training_state.pt and hooks.pt through ``CheckpointStore.save``, then prunes; a barrier keeps every
rank behind a checkpoint that is not durable yet.

A sharded checkpoint: every rank takes its own shards (nothing is gathered), rank 0 makes the
temporary directory and every rank learns it, every rank writes its shards there with DCP and
describes its files, and rank 0 lists them all in the manifest (``CheckpointStore.save(into=...)``);
rank 0's outcome, broadcast, is the barrier, and a failure is the same CheckpointError on every rank.

With ``async_save`` everything from the write on runs on ``BackgroundSaves``' thread from a staged
CPU copy (``background.stage``); the hook logs the save once it is settled.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from torch import Tensor

from trainfsm import activity, collectives
from trainfsm.checkpoint.background import BackgroundSaves, stage
from trainfsm.checkpoint.io import describe_file
from trainfsm.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore
from trainfsm.machine import ExitReason
from trainfsm.trail.console import CONSOLE_ONLY, notice

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

#: trainer.state_dict() keys that go to model.pt / training_state.pt; anything else came from a hook.
MODEL_KEYS = ("model",)
TRAINING_KEYS = ("optimizer", "lr_scheduler", "grad_scaler", "step", "epoch")


class Saved(NamedTuple):
    path: Path
    kept: bool
    bytes: int
    checksum: str
    seconds: float
    pruned: list[Checkpoint]
    direct_io: bool  # every file the store wrote went past the page cache (O_DIRECT)
    data: dict[str, Any] | None = None  # the data positions saved with it (``data_positions``)
    write_mode: dict[str, Any] | None = None  # why it wrote that way: ``chosen_by``, ``rates`` (writemode.Choice)


#: What a background save returns: rank 0's ``Saved`` (None on the other ranks of a sharded save)
#: and, for a sharded one, the world size that wrote it.
SaveResult: TypeAlias = tuple[Saved | None, int | None]


class ShardedSave(NamedTuple):
    """What the ranks agreed on before a sharded save writes anything."""

    store: CheckpointStore
    rank: int
    world: int
    step: int
    keep: bool
    tmp: Path  # rank 0's temporary directory, the same on every rank
    ranks: list[dict[str, Any]]  # every rank's random state and data position


class Saver:
    """Writes one run's checkpoints into ``store``, pruning to the newest ``keep_previous + 1``;
    with ``background``, on its writer thread."""

    def __init__(
        self,
        store: CheckpointStore,
        keep_previous: int,
        checksum: str,
        background: BackgroundSaves[SaveResult] | None,
    ) -> None:
        self.store = store
        self.keep_previous = keep_previous
        self.checksum = checksum
        self.background = background

    def save(self, trainer: BaseTrainer, keep: bool, sharded: bool) -> None:
        """Save ``trainer``'s state at its step (``keep``: never pruned); collective on every rank."""
        if sharded:
            self._save_sharded(trainer, keep)
        else:
            self._save_full(trainer, keep)

    def _save_full(self, trainer: BaseTrainer, keep: bool) -> None:
        state = trainer.state_dict()  # every rank: FSDP gathers collectively
        refuse_sharded(state["model"])  # on every rank alike, before any rank writes or waits
        ranks = collectives.gather_objects(state.pop("rank_state"))
        check_ranks_in_step(ranks, trainer.step)  # on every rank alike, before anything is written
        if trainer.rank == 0:
            started = time.perf_counter()
            parts = with_hooks(
                state,
                model={key: state[key] for key in MODEL_KEYS},
                training_state={**{key: state[key] for key in TRAINING_KEYS}, "ranks": ranks},
            )
            step = trainer.step
            if self.background is not None:
                staged, copies = stage(parts, trainer, self.background.spare)
                self.background.submit(started, copies, lambda: (self._write(step, staged, keep), None), sharded=False)
            else:
                log_saved(trainer, self._write(step, parts, keep), blocked=None)
        collectives.barrier()  # no rank runs ahead of a checkpoint that is not durable yet

    def _save_sharded(self, trainer: BaseTrainer, keep: bool) -> None:
        """Rank 0 makes the temporary directory and every rank learns it, with every rank's random
        state and data position (one collective); then ``_write_sharded``, here or, with a
        ``background``, on its writer thread from a CPU copy of this rank's shards, over a process
        group of its own so that its collectives never meet the training's."""
        from trainfsm.checkpoint import sharded

        store = self.store
        rank, world = trainer.rank, trainer.world_size
        step = trainer.step
        started = time.perf_counter()
        view = sharded.sharded_view(trainer.state_dict_options)
        state = trainer.state_dict(options=view)  # each rank its own shards: nothing is gathered
        mine = state.pop("rank_state")
        tmp: Path | None = None
        error: str | None = None
        if rank == 0:
            try:
                tmp = store.begin(step)
            except OSError as exc:
                error = f"could not create a directory under {store.root}: {exc}"
        shared = collectives.gather_objects({"state": mine, "tmp": None if tmp is None else str(tmp), "error": error})
        if shared[0]["error"] is not None:
            raise CheckpointError(f"sharded checkpoint at step {step} was not saved: rank 0 {shared[0]['error']}")
        try:
            check_ranks_in_step([entry["state"] for entry in shared], step)
        except RuntimeError:
            if tmp is not None:
                store.discard(tmp)
            raise
        tmp = Path(shared[0]["tmp"])
        job = ShardedSave(store, rank, world, step, keep, tmp, [entry["state"] for entry in shared])
        if self.background is None:
            saved = self._write_sharded(job, state, started)
            if saved is not None:
                log_saved(trainer, saved, blocked=None, world=world)
            return
        group = self.background.process_group(world)  # collective: every rank is here, at the same save
        staged, copies = stage(state, trainer, self.background.spare)

        def write() -> SaveResult:
            return self._write_sharded(job, staged, time.perf_counter(), group), world

        self.background.submit(started, copies, write, sharded=True)

    def _write(self, step: int, parts: dict[str, Any], keep: bool, **sharded: Any) -> Saved:
        """Save, then prune: ``latest`` has moved to a durable checkpoint before anything is deleted.
        ``sharded``: ``into``, ``written``, ``world_size`` of a sharded save (see ``CheckpointStore.save``)."""
        store = self.store
        started = time.perf_counter()
        checkpoint, size, checksum = store.save(step, parts, keep=keep, **sharded)
        seconds = time.perf_counter() - started
        pruned = store.prune(self.keep_previous)
        data = data_positions(parts["training_state"].get("ranks") or [])
        choice = store.written_with
        mode = None if choice is None else {"chosen_by": choice.chosen_by, "rates": choice.rates}
        return Saved(
            checkpoint.path, checkpoint.kept, size, checksum, seconds, pruned, store.wrote_directly, data, mode
        )

    def _write_sharded(
        self, job: ShardedSave, state: dict[str, Any], started: float, group: Any = None
    ) -> Saved | None:
        """Every rank writes its shards (DCP) into ``job.tmp``; rank 0 writes the rest and, once every
        rank's files are durable and listed, the manifest; then every rank learns the outcome. Two
        collectives over ``group`` besides DCP's own: the files' entries, the outcome. Returns rank 0's
        ``Saved`` (None on the other ranks); a failure raises the same CheckpointError on every rank
        and leaves the previous complete checkpoint in place."""
        try:
            return self._write_shards_then_rest(job, state, started, group)
        except BaseException:
            if job.rank == 0:  # e.g. a peer died: this save can never complete; leave nothing behind
                job.store.discard(job.tmp)
            raise

    def _write_shards_then_rest(
        self, job: ShardedSave, state: dict[str, Any], started: float, group: Any
    ) -> Saved | None:
        from trainfsm.checkpoint import sharded

        rank, world, tmp = job.rank, job.world, job.tmp
        directory = tmp / sharded.SUBDIR
        error: str | None = None
        written: dict[str, dict[str, Any]] = {}
        try:
            model_and_optimizer = {"model": state["model"], "optimizer": state["optimizer"]}
            for name in sharded.save(model_and_optimizer, directory, rank, group):
                written[f"{sharded.SUBDIR}/{name}"] = {**describe_file(directory / name, self.checksum), "rank": rank}
        except Exception as exc:  # reported to rank 0 below, so that no rank waits for another
            error = f"{type(exc).__name__}: {exc}"
        entries = collectives.gather_objects({"files": written, "error": error}, group)
        outcome: str | None = None
        saved: Saved | None = None
        if rank == 0:
            errors = [f"rank {r}: {e['error']}" for r, e in enumerate(entries) if e["error"] is not None]
            if errors:
                job.store.discard(tmp)
                outcome = "; ".join(errors)
            else:
                training = {key: state[key] for key in TRAINING_KEYS if key != "optimizer"}  # optimizer: DCP
                parts = with_hooks(state, training_state={**training, "ranks": job.ranks})
                files = {name: entry for e in entries for name, entry in e["files"].items()}
                try:
                    saved = self._write(job.step, parts, job.keep, into=tmp, written=files, world_size=world)
                except Exception as exc:  # store.save removed the directory
                    outcome = f"{type(exc).__name__}: {exc}"
        # The outcome doubles as the barrier: no rank runs ahead of a checkpoint that is not durable.
        outcome = collectives.from_rank0(outcome, group)
        if outcome is not None:
            raise CheckpointError(
                f"sharded checkpoint at step {job.step} was not saved ({outcome}); the previous complete "
                f"checkpoint is kept"
            )
        return None if saved is None else saved._replace(seconds=time.perf_counter() - started)


def log_saved(trainer: BaseTrainer, saved: Saved, blocked: float | None, world: int | None = None) -> None:
    """The ``checkpoint_saved`` event (``blocked``: seconds the loop waited for an asynchronous save,
    None for one made in the step); ``world``: the world size that wrote a sharded checkpoint
    (``bytes`` counts every rank's files)."""
    trainer.events.info(
        "checkpoint_saved",
        path=str(saved.path),
        saved_step=int(saved.path.name.removesuffix("_keep")),
        bytes=saved.bytes,
        seconds=round(saved.seconds, 6),
        checksum=saved.checksum,
        kept=saved.kept,
        asynchronous=blocked is not None,
        sharded=world is not None,
        direct_io=saved.direct_io,
        chosen_by=None if saved.write_mode is None else saved.write_mode["chosen_by"],
        rates=None if saved.write_mode is None else saved.write_mode["rates"],
        data=saved.data,
        **({"blocked_seconds": round(blocked, 6)} if blocked is not None else {}),
        **({"world_size": world} if world is not None else {}),
        # The console's line names what the save pruned (one line per save); the trail has its event.
        **({CONSOLE_ONLY: {"pruned": [str(c.path) for c in saved.pruned]}} if saved.pruned else {}),
    )
    if saved.pruned:
        trainer.events.info("checkpoint_pruned", paths=[str(c.path) for c in saved.pruned])
    if trainer.exit_reason is ExitReason.PREEMPTED and trainer.rank == 0:
        notice(
            trainer.logger,
            f"preempted: checkpoint {saved.path.name} saved ({saved.path}); exiting {trainer.exit_code}",
        )


def data_positions(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The data ledger's entry for a save (``checkpoint_saved.data``): the position each rank saved,
    as (epoch, batches drawn in it); ``{"epoch": e, "batches": b}`` when every rank saved the same
    (with ``global``: ``{epoch, samples, world_size}``, the position in the epoch's order, where the
    ranks' order is known), else ``{"ranks": [[e, b], ...]}`` in rank order. ``trainfsm audit`` checks that each resume
    restores exactly this, so that every batch is trained once across attempts."""
    found = [(int(r["data"]["epoch"]), int(r["data"]["batches"])) for r in ranks if r.get("data") is not None]
    if not found or len(found) != len(ranks):
        return None
    if len(set(found)) > 1:
        return {"ranks": [list(position) for position in found]}
    # Where every rank maps its position onto the epoch's order (trainfsm.data_order), the same one.
    positions = [r["data"].get("global") for r in ranks]
    same = positions[0] is not None and all(p == positions[0] for p in positions)
    entry: dict[str, Any] = {"epoch": found[0][0], "batches": found[0][1]}
    return {**entry, "global": {**positions[0], "world_size": len(ranks)}} if same else entry


def saves_sharded(trainer: BaseTrainer, current: dict[str, Any], setting: bool | str) -> bool:
    """Whether CHECKPOINT writes sharded checkpoints (``setting``: the hook's ``sharded``), from
    ``current``, the model state's keys and shapes; decided once in RESTORE, alike on every rank."""
    from trainfsm.checkpoint.sharded import holds_sharded, is_sharded

    options = trainer.state_dict_options
    split = holds_sharded(current) and not (options is not None and options.full_state_dict)
    if setting is False:
        if split:
            raise _refusal(next(key for key, value in current.items() if is_sharded(value)))
        return False
    return setting is True or split


def with_hooks(state: dict[str, Any], **parts: Any) -> dict[str, Any]:
    """``parts`` (file stem -> object), plus ``hooks`` when ``state`` holds hook state."""
    extra = {key: value for key, value in state.items() if key not in MODEL_KEYS + TRAINING_KEYS}
    return {**parts, "hooks": extra} if extra else parts


def check_ranks_in_step(ranks: list[dict[str, Any]], step: int) -> None:
    """Refuse to save ranks that went apart: one skipped a micro-batch for ``loss=None`` alone.

    Without ``loss_none_agreement`` the ranks do not tell each other about a skip; one that skips
    alone pairs its next gradient all-reduce with the others' current one. Nothing may become
    durable after that, so every rank raises the same error here (they all hold the same list).
    """
    skips = [entry.get("loss_none_skips", 0) for entry in ranks]
    if len(set(skips)) > 1:
        counts = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(skips))
        raise RuntimeError(
            f"step {step}: the ranks skipped different numbers of micro-batches for loss=None in this launch "
            f"({counts}), so gradients were averaged across different micro-batches and the ranks' data "
            f"positions differ. Nothing was saved at this step; the last complete checkpoint is intact. Return "
            f"None on every rank at the same micro-batch, or pass loss_none_agreement=True to the trainer so "
            f"that every rank skips a micro-batch that any rank returned None for."
        )


def refuse_sharded(model_state: dict[str, Any]) -> None:
    """Rank 0 writes a full checkpoint alone: a model state split over ranks would save rank 0's
    shards only, and a resume would load them into every rank's shard."""
    from trainfsm.checkpoint.sharded import is_sharded

    for key, value in model_state.items():
        # A plain tensor is not asked (a missed attribute costs, in a save the loop waits for).
        if type(value) is not Tensor and is_sharded(value):
            raise _refusal(key, f" ({type(value).__name__} {value.placements})")


def _refusal(key: str, what: str = "") -> CheckpointError:
    return CheckpointError(
        f"model state {key!r} is sharded over ranks{what}, but CheckpointingHook(sharded=False) writes "
        f"rank 0's state only; pass sharded='auto' (the default) or True to have every rank write its "
        f"shards with torch.distributed.checkpoint, or the trainer state_dict_options="
        f"StateDictOptions(full_state_dict=True, cpu_offload=True) "
        f"(torch.distributed.checkpoint.state_dict) to save the whole model from rank 0."
    )


activity.name(Saver.save, "a checkpoint save")
