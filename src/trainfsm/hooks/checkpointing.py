"""``CheckpointingHook``: saves in CHECKPOINT, loads in RESTORE, through ``CheckpointStore``."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from trainfsm import data_state, rng
from trainfsm.checkpoint import Checkpoint, CheckpointError, CheckpointStore, check_fits
from trainfsm.checkpoint_io import check_checksum, describe_file
from trainfsm.events import notice
from trainfsm.hooks.base import BaseHook
from trainfsm.signals import DEFAULT_EXIT_SIGNALS, exit_policy
from trainfsm.utils import map_nested_tensor
from trainfsm.validation import int_at_least

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

#: trainer.state_dict() keys that go to model.pt / training_state.pt; anything else came from a hook.
MODEL_KEYS = ("model",)
TRAINING_KEYS = ("optimizer", "lr_scheduler", "grad_scaler", "step", "epoch")


class CheckpointingHook(BaseHook):
    """Save every ``interval`` steps (and at ``keep_interval`` / ``keep_steps`` and at the end),
    keep the newest ``keep_previous + 1`` plus every kept one, and resume from ``load``.

    ``exit_signals`` / ``exit_code`` / ``exit_wait``: on one of these signals, finish the current
    optimizer step, checkpoint, and exit with ``128 + signal`` (or ``exit_code``) after ``exit_wait``
    seconds. By default (None) SIGTERM and SIGUSR1, what schedulers send before a kill: a run is
    preemption-safe without asking (``trainloop``'s hook handles none by default); ``[]`` handles none.
    ``requeue`` (``"auto"``: inside a SLURM batch job) puts the SLURM job back in the queue once
    the checkpoint is durable, at most ``max_requeues`` times (counted by SLURM_RESTART_COUNT).
    ``data_resume`` says how the data iterator gets back to where it was (see ``trainfsm.data_state``).
    ``async_save`` stages the state to CPU memory and writes it on a background thread while
    training goes on: at most one save in flight, a failure raises at the next step or at EXIT, and
    EXIT waits until the last save is durable.

    ``sharded`` says how a model state split over ranks (FSDP2 ``fully_shard`` with the default
    ``state_dict_options``) is saved: ``"auto"`` (default) writes a sharded checkpoint exactly then,
    and a full one from rank 0 otherwise; ``True`` always writes sharded checkpoints; ``False``
    always writes from rank 0 and refuses a sharded state. In a sharded checkpoint every rank
    writes its own shards of the model and optimizer with ``torch.distributed.checkpoint`` into the
    one temporary directory rank 0 made; the checkpoint is complete (manifest, rename, ``latest``)
    only once every rank's files are durable, so the ranks must share one filesystem. Loading
    follows the checkpoint, whatever ``sharded`` says; a sharded one loads on any world size (DCP
    reshards). With ``async_save`` every rank copies its shards to CPU memory and writes them on its
    background thread, over a gloo process group the hook makes for that at its first save (so a
    sharded ``async_save`` needs every rank to save at the same steps, as it does anyway); a
    failed sharded save raises on every rank at the next checkpoint or at EXIT.

    ``checksum``: what the manifest lists for each 4 MiB of every file, ``"xxh3_128"`` (default: fast;
    it guards against torn writes, bit rot and truncation, which is what a checksum stored beside the
    data can do) or ``"sha256"``. Loading verifies with whichever one a checkpoint's manifest names.

    ``direct_io`` (default True) writes checkpoint files past the page cache (``O_DIRECT``) where the
    file system allows it, and through it elsewhere; ``False`` always goes through the page cache,
    for a file system where that is faster (see ``CheckpointStore``).
    """

    def __init__(
        self,
        interval: int,
        keep_previous: int = 0,
        keep_interval: int = 0,
        keep_steps: Iterable[int] | None = None,
        path: Path | str = "checkpoints",
        load: Path | str | Literal["latest"] | None = "latest",
        exit_signals: list[signal.Signals] | signal.Signals | None = None,
        exit_code: int | Literal["128+signal"] = "128+signal",
        exit_wait: timedelta | float = 0.0,
        data_resume: str = "auto",
        async_save: bool = False,
        requeue: bool | Literal["auto"] = "auto",
        max_requeues: int | None = None,
        sharded: bool | Literal["auto"] = "auto",
        direct_io: bool = True,
        checksum: Literal["xxh3_128", "sha256"] = "xxh3_128",
    ) -> None:
        self.interval = int_at_least("CheckpointingHook interval", interval, 1)
        self.keep_previous = int_at_least("CheckpointingHook keep_previous", keep_previous, 0)
        self.keep_interval = int_at_least("CheckpointingHook keep_interval", keep_interval, 0)
        steps = [] if keep_steps is None else list(keep_steps)
        for step in steps:
            int_at_least("CheckpointingHook keep_steps", step, 1)
        self.keep_steps = frozenset(steps)
        if not isinstance(path, (str, Path)) or str(path) == "":
            raise TypeError(f"CheckpointingHook path must be a non-empty str or Path; got {path!r}.")
        self.path = Path(path)
        if load is not None and not isinstance(load, (str, Path)):
            raise TypeError(f"CheckpointingHook load must be 'latest', a path or None; got {load!r}.")
        self.load = load
        if exit_signals is None:
            exit_signals = list(DEFAULT_EXIT_SIGNALS)
        self.exit_policy = exit_policy(
            "CheckpointingHook", exit_signals, exit_code, exit_wait, requeue=requeue, max_requeues=max_requeues
        )
        self.exit_signals = self.exit_policy.signals
        self.exit_code = self.exit_policy.code
        self.exit_wait = self.exit_policy.wait
        if data_resume not in data_state.MODES:
            raise ValueError(f"CheckpointingHook data_resume must be one of {data_state.MODES}; got {data_resume!r}.")
        self.data_resume = data_resume
        self.async_save = async_save
        if not (isinstance(sharded, bool) or (isinstance(sharded, str) and sharded == "auto")):
            raise ValueError(
                f"CheckpointingHook sharded must be True, False or 'auto' (sharded exactly when the model "
                f"state is split over ranks); got {sharded!r}."
            )
        self.sharded = sharded
        if not isinstance(direct_io, bool):
            raise TypeError(f"CheckpointingHook direct_io must be True or False; got {direct_io!r}.")
        self.direct_io = direct_io
        self.saves_sharded = False  # decided in RESTORE, from the model and the trainer's options
        self.store: CheckpointStore | None = None
        self.loaded_from: Path | None = None
        self._on_disk: int | None = None  # the step last saved or loaded: never written twice
        self._writer: ThreadPoolExecutor | None = None
        # The save in flight: rank 0's _Saved (None on the other ranks of a sharded save) and, for a
        # sharded one, the world size that wrote it.
        self._inflight: Future[tuple[_Saved | None, int | None]] | None = None
        self._group: Any = None  # the process group of background sharded saves (made at the first)
        self._inflight_sharded = False
        self._failure_reported = False
        self._staging: threading.Event | None = None
        self._blocked = 0.0
        self.checksum = check_checksum("CheckpointingHook", checksum)

    # ------------------------------------------------------------------ RESTORE
    def on_enter_restore(self, trainer: BaseTrainer) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from trainfsm.sharded import sharded_view

        self.store = store = CheckpointStore(self._root(trainer), direct_io=self.direct_io, checksum=self.checksum)
        log = trainer.audit
        if trainer.rank == 0:
            removed = store.remove_leftovers()
            if removed:
                log.warning("checkpoint_tmp_removed", names=removed)
            # The writer's one-off set-up here, not in the first save's step (rank 0 writes).
            log.debug("checkpoint_store_ready", seconds=round(store.prepare(), 6))
        # Keys and (global) shapes only, on every rank alike: a sharded view needs no gather, and a
        # full one with cpu_offload=True is empty on every rank but 0.
        current = get_model_state_dict(trainer.model, options=sharded_view(trainer.state_dict_options))  # type: ignore[arg-type]
        self.saves_sharded = self._saves_sharded(trainer, current)
        if self.load is None:
            return
        if self.load == "latest":
            # Rank 0's list: every rank tries the same checkpoints in the same order.
            names = _from_rank0([c.path.name for c in store.candidates()], trainer.world_size)
            for name in names:
                path = store.root / name
                try:
                    manifest, parts = self._verified(trainer, path)
                except CheckpointError as exc:
                    log.warning("checkpoint_skipped", path=str(path), reason=str(exc))
                    continue
                self._restore(trainer, path, manifest, parts, current)
                return
            return
        path = Path(self.load)
        if not path.is_absolute() and (store.root / path).exists():  # "1000" means checkpoints/1000
            path = store.root / path
        manifest, parts = self._verified(trainer, path)
        self._restore(trainer, path, manifest, parts, current)

    def _saves_sharded(self, trainer: BaseTrainer, current: dict[str, Any]) -> bool:
        """Whether CHECKPOINT writes sharded checkpoints; decided once, alike on every rank."""
        from trainfsm.sharded import holds_sharded, is_sharded

        options = trainer.state_dict_options
        split = holds_sharded(current) and not (options is not None and options.full_state_dict)
        if self.sharded is False:
            if split:
                raise _refusal(next(key for key, value in current.items() if is_sharded(value)))
            return False
        return self.sharded is True or split

    def _verified(self, trainer: BaseTrainer, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
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
            manifest = CheckpointStore.verify(path, share=(rank, world))
            parts = CheckpointStore.load(path, manifest)
        except CheckpointError as exc:
            error = str(exc)
        if world > 1:
            found = _gather({"error": error}, world)
            error = next((f"rank {r}: {e['error']}" for r, e in enumerate(found) if e["error"] is not None), None)
        if error is not None:
            raise CheckpointError(error)
        return manifest, parts

    def _restore(
        self, trainer: BaseTrainer, path: Path, manifest: dict[str, Any], parts: dict[str, Any], current: dict[str, Any]
    ) -> None:
        state = {**parts.get("model", {}), **parts.get("training_state", {}), **parts.get("hooks", {})}
        ranks = state.pop("ranks", None)
        sharded = bool(manifest.get("sharded"))
        if sharded:
            self._load_sharded(trainer, path, state, current)
        else:
            check_fits(path, current, state["model"])
            trainer.load_state_dict(state)
        if ranks:
            # Each rank resumes its own random streams; on a different world size, rank 0's.
            mine = ranks[trainer.rank] if trainer.rank < len(ranks) else ranks[0]
            if self.data_resume == "none":
                rng.restore(mine["rng"])
            else:
                trainer.resume_data(self.data_resume, mine["data"], mine["rng"])
        self.loaded_from = path
        self._on_disk = trainer.step
        trainer.audit.info(
            "checkpoint_loaded",
            path=str(path),
            from_step=trainer.step,
            sharded=sharded,
            **({"saved_world_size": manifest.get("world_size")} if sharded else {}),
        )
        if trainer.rank == 0:
            notice(trainer.logger, f"resumed from checkpoint {trainer.step} ({path})")

    def _load_sharded(self, trainer: BaseTrainer, path: Path, state: dict[str, Any], current: dict[str, Any]) -> None:
        """Model and optimizer in place with DCP (each rank reads what its shards need, whatever the
        world size that saved them), then the rest through ``trainer.load_state_dict``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from trainfsm import sharded

        directory = path / sharded.SUBDIR
        check_fits(path, current, sharded.saved_shapes(sharded.read_metadata(directory)))
        view = sharded.sharded_view(trainer.state_dict_options)
        # The optimizer's state exists only after a step; get_state_dict creates it (zeros) so that
        # DCP has tensors to read into.
        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer, options=view)  # type: ignore[arg-type]
        target = {"model": model_state, "optimizer": optim_state}
        sharded.load(target, directory)
        with _state_dict_options(trainer, view):
            trainer.load_state_dict({**state, **target})

    # ------------------------------------------------------------------ CHECKPOINT
    def wants_checkpoint(self, trainer: BaseTrainer) -> bool:
        step = trainer.step
        return (
            step % self.interval == 0
            or self._kept(step)
            or trainer.exit_reason is not None  # the last step, or a stop: never lose the end
        )

    def _kept(self, step: int) -> bool:
        return step in self.keep_steps or (self.keep_interval > 0 and step % self.keep_interval == 0)

    def on_enter_checkpoint(self, trainer: BaseTrainer) -> None:
        self._settle(trainer, wait=True)  # at most one save in flight
        if trainer.step == self._on_disk:
            # Only ``exhausted`` (max_epochs) comes here for a step already saved or loaded.
            return
        self._on_disk = trainer.step
        if self.saves_sharded:
            self._save_sharded(trainer)
            return
        state = trainer.state_dict()  # every rank: FSDP gathers collectively
        _refuse_sharded(state["model"])  # on every rank alike, before any rank writes or waits
        ranks = _gather(_rank_state(trainer), trainer.world_size)
        _check_ranks_in_step(ranks, trainer.step)  # on every rank alike, before anything is written
        if trainer.rank == 0:
            started = time.perf_counter()
            parts = _with_hooks(
                state,
                model={key: state[key] for key in MODEL_KEYS},
                training_state={**{key: state[key] for key in TRAINING_KEYS}, "ranks": ranks},
            )
            step, keep = trainer.step, self._kept(trainer.step)
            if self.async_save:
                staged, copies = _stage(parts, trainer)
                self._submit(started, copies, lambda: (self._write(step, staged, keep), None), sharded=False)
            else:
                self._log_saved(trainer, self._write(step, parts, keep), blocked=None)
        _barrier(trainer.world_size)  # no rank runs ahead of a checkpoint that is not durable yet

    def _save_sharded(self, trainer: BaseTrainer) -> None:
        """Rank 0 makes the temporary directory and every rank learns it, with every rank's random
        state and data position (one collective); then ``_write_sharded``, here or, with
        ``async_save``, on the writer thread from a CPU copy of this rank's shards, over a process
        group of its own (``_background_group``) so that its collectives never meet the training's."""
        from trainfsm import sharded

        store = self._opened_store()
        rank, world = trainer.rank, trainer.world_size
        step, keep = trainer.step, self._kept(trainer.step)
        started = time.perf_counter()
        view = sharded.sharded_view(trainer.state_dict_options)
        with _state_dict_options(trainer, view):
            state = trainer.state_dict()  # each rank its own shards: nothing is gathered
        tmp: Path | None = None
        error: str | None = None
        if rank == 0:
            try:
                tmp = store.begin(step)
            except OSError as exc:
                error = f"could not create a directory under {store.root}: {exc}"
        shared = _gather(
            {"state": _rank_state(trainer), "tmp": None if tmp is None else str(tmp), "error": error}, world
        )
        if shared[0]["error"] is not None:
            raise CheckpointError(f"sharded checkpoint at step {step} was not saved: rank 0 {shared[0]['error']}")
        try:
            _check_ranks_in_step([entry["state"] for entry in shared], step)
        except RuntimeError:
            if tmp is not None:
                store.discard(tmp)
            raise
        tmp = Path(shared[0]["tmp"])
        job = _ShardedSave(store, rank, world, step, keep, tmp, [entry["state"] for entry in shared])
        if not self.async_save:
            saved = self._write_sharded(job, state, started)
            if saved is not None:
                self._log_saved(trainer, saved, blocked=None, world=world)
            return
        if self._group is None and world > 1:  # one rank has no collective to mispair
            self._group = _background_group()  # collective: every rank is here, at the same save
        staged, copies = _stage(state, trainer)
        group = self._group
        self._submit(
            started, copies, lambda: (self._write_sharded(job, staged, time.perf_counter(), group), world), sharded=True
        )

    def _submit(
        self,
        started: float,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        write: Callable[[], tuple[_Saved | None, int | None]],
        *,
        sharded: bool,
    ) -> None:
        """Make ``copies`` on the writer thread, then ``write()`` there; the loop was blocked since
        ``started``, and is blocked again before the next optimizer step until the copies are made."""
        self._blocked = time.perf_counter() - started
        self._staging = threading.Event()
        self._inflight_sharded = sharded
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainfsm-async-save")
        self._inflight = self._writer.submit(_copy_then, copies, self._staging, write)

    def _write_sharded(
        self, job: _ShardedSave, state: dict[str, Any], started: float, group: Any = None
    ) -> _Saved | None:
        """Every rank writes its shards (DCP) into ``job.tmp``; rank 0 writes the rest and, once every
        rank's files are durable and listed, the manifest; then every rank learns the outcome. Two
        collectives over ``group`` besides DCP's own: the files' entries, the outcome. Returns rank 0's
        ``_Saved`` (None on the other ranks); a failure raises the same CheckpointError on every rank
        and leaves the previous complete checkpoint in place."""
        try:
            return self._write_shards_then_rest(job, state, started, group)
        except BaseException:
            if job.rank == 0:  # e.g. a peer died: this save can never complete; leave nothing behind
                job.store.discard(job.tmp)
            raise

    def _write_shards_then_rest(
        self, job: _ShardedSave, state: dict[str, Any], started: float, group: Any
    ) -> _Saved | None:
        from trainfsm import sharded

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
        entries = _gather({"files": written, "error": error}, world, group)
        outcome: str | None = None
        saved: _Saved | None = None
        if rank == 0:
            errors = [f"rank {r}: {e['error']}" for r, e in enumerate(entries) if e["error"] is not None]
            if errors:
                job.store.discard(tmp)
                outcome = "; ".join(errors)
            else:
                training = {key: state[key] for key in TRAINING_KEYS if key != "optimizer"}  # optimizer: DCP
                parts = _with_hooks(state, training_state={**training, "ranks": job.ranks})
                files = {name: entry for e in entries for name, entry in e["files"].items()}
                try:
                    saved = self._write(job.step, parts, job.keep, into=tmp, written=files, world_size=world)
                except Exception as exc:  # store.save removed the directory
                    outcome = f"{type(exc).__name__}: {exc}"
        # The outcome doubles as the barrier: no rank runs ahead of a checkpoint that is not durable.
        outcome = _from_rank0(outcome, world, group)
        if outcome is not None:
            raise CheckpointError(
                f"sharded checkpoint at step {job.step} was not saved ({outcome}); the previous complete "
                f"checkpoint is kept"
            )
        return None if saved is None else saved._replace(seconds=time.perf_counter() - started)

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        """The first in-place update of parameters or optimizer state must wait for the copy."""
        if self._staging is not None:
            self._wait_staged()

    def _wait_staged(self) -> None:
        if self._staging is not None:
            started = time.perf_counter()
            self._staging.wait()
            self._blocked += time.perf_counter() - started
            self._staging = None

    def _opened_store(self) -> CheckpointStore:
        if self.store is None:
            raise RuntimeError("CheckpointingHook saves in CHECKPOINT only after RESTORE opened its store")
        return self.store

    def _write(self, step: int, parts: dict[str, Any], keep: bool, **sharded: Any) -> _Saved:
        """Save, then prune: ``latest`` has moved to a durable checkpoint before anything is deleted.
        ``sharded``: ``into``, ``written``, ``world_size`` of a sharded save (see ``CheckpointStore.save``)."""
        store = self._opened_store()
        started = time.perf_counter()
        checkpoint, size, checksum = store.save(step, parts, keep=keep, **sharded)
        seconds = time.perf_counter() - started
        pruned = store.prune(self.keep_previous)
        return _Saved(checkpoint.path, checkpoint.kept, size, checksum, seconds, pruned, store.wrote_directly)

    def _log_saved(self, trainer: BaseTrainer, saved: _Saved, blocked: float | None, world: int | None = None) -> None:
        """``world``: the world size that wrote a sharded checkpoint (``bytes`` counts every rank's files)."""
        trainer.audit.info(
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
            **({"blocked_seconds": round(blocked, 6)} if blocked is not None else {}),
            **({"world_size": world} if world is not None else {}),
        )
        if saved.pruned:
            trainer.audit.info("checkpoint_pruned", paths=[str(c.path) for c in saved.pruned])
        if trainer.exit_reason == "preempted" and trainer.rank == 0:
            notice(
                trainer.logger,
                f"preempted: checkpoint {saved.path.name} saved ({saved.path}); exiting {trainer.exit_code}",
            )

    def _settle(self, trainer: BaseTrainer, wait: bool) -> None:
        """Report a finished asynchronous save; with ``wait``, wait for it. A failed save raises here:
        a full one at the next step, a sharded one at the next checkpoint or at EXIT. The ranks of
        a sharded save learn its outcome together but each looks at its own pace, so each would raise
        at a different step and leave the others waiting in a collective; the checkpoint and EXIT are
        where every rank is at once. The ``checkpoint_failed`` event comes at the next step either way."""
        future = self._inflight
        if future is None or (not wait and not future.done()):
            return
        self._wait_staged()
        error = future.exception()
        if error is None:
            self._inflight = None
            saved, world = future.result()
            if saved is not None:
                self._log_saved(trainer, saved, blocked=self._blocked, world=world)
            return
        if not self._failure_reported:
            trainer.audit.error("checkpoint_failed", type=type(error).__name__, message=str(error))
            self._failure_reported = True
        if not wait and self._inflight_sharded:
            return  # raised where every rank is at once: the next checkpoint or EXIT
        self._inflight = None
        self._failure_reported = False
        raise CheckpointError(f"asynchronous checkpoint save failed: {type(error).__name__}: {error}") from error

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if self._inflight is not None:
            self._settle(trainer, wait=False)

    def on_after_train(self, trainer: BaseTrainer) -> None:
        """EXIT waits until the last save is durable, then releases the I/O threads."""
        try:
            self._settle(trainer, wait=True)
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            if self._group is not None:  # local for gloo; a group kept alive could abort the exit
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group(self._group)
                self._group = None
            if self.store is not None:
                self.store.close()
            if trainer.exit_reason not in ("failed", "interrupted"):  # a failing rank may never arrive
                _barrier(trainer.world_size)

    def _root(self, trainer: BaseTrainer) -> Path:
        workspace = trainer.workspace
        if self.path.is_absolute():
            return self.path
        if workspace is not None and (self.path == workspace or workspace in self.path.parents):
            return self.path  # already under the workspace, as in `path=self.workspace / "checkpoints"`
        if workspace is None:
            raise ValueError(
                f"CheckpointingHook(path={str(self.path)!r}) is relative and the trainer has no workspace; "
                f"pass workspace=... to the trainer or an absolute path to the hook."
            )
        return workspace / self.path


class _Saved(NamedTuple):
    path: Path
    kept: bool
    bytes: int
    checksum: str
    seconds: float
    pruned: list[Checkpoint]
    direct_io: bool  # every file the store wrote went past the page cache (O_DIRECT)


class _ShardedSave(NamedTuple):
    """What the ranks agreed on before a sharded save writes anything."""

    store: CheckpointStore
    rank: int
    world: int
    step: int
    keep: bool
    tmp: Path  # rank 0's temporary directory, the same on every rank
    ranks: list[dict[str, Any]]  # every rank's random state and data position


def _background_group() -> Any:
    """A gloo group over every rank for the collectives of background sharded saves (DCP's and
    ours): on the default group they could pair with the training's, which run at the same time on
    the main thread. Collective: every rank calls it at the same point."""
    import torch.distributed as dist

    from trainfsm.agreement import group_timeout

    return dist.new_group(backend="gloo", timeout=group_timeout())


def _copy_then(
    copies: list[tuple[torch.Tensor, torch.Tensor]], staged_event: threading.Event, write: Callable[[], Any]
) -> Any:
    """On the writer thread: the copies the loop waits for before its next optimizer step, then ``write()``."""
    try:
        for source, target in copies:
            target.copy_(source)  # releases the GIL: overlaps the next step's forward/backward
    finally:
        staged_event.set()
    return write()


def _stage(parts: dict[str, Any], trainer: BaseTrainer) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A private CPU copy of ``parts`` for the background writer, and the copies still to make.

    What a forward pass may change in place (buffers such as BatchNorm's running statistics, and
    anything else that is not a parameter) is copied now. Parameters, optimizer state and hook
    state change only from the next ``optimizer.step()`` on, so they are copied on the writer
    thread while the next step's data loading, forward and backward run; ``on_before_optimizer_step``
    waits for those copies.
    """
    model = trainer.model
    parameters = {_local(p).data_ptr() for p in model.parameters()} if model is not None else set()
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def later(tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor).detach()
        target = torch.empty_like(local, device="cpu")
        copies.append((local, target))
        return _shaped_like(tensor, target)

    def now(tensor: torch.Tensor) -> torch.Tensor:
        return _shaped_like(tensor, _local(tensor).detach().to("cpu", copy=True))

    staged = {
        part: map_nested_tensor(
            (lambda t: later(t) if _local(t).data_ptr() in parameters else now(t)) if part == "model" else later, value
        )
        for part, value in parts.items()
    }
    return staged, copies


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a shard of a sharded save); any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and hasattr(tensor, "placements") else tensor


def _shaped_like(original: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a CPU copy of ``original``'s part) as what DCP must see: a DTensor with the same
    mesh, placements and global shape when ``original`` is one, so that it is written as the same
    shard of the same global tensor.

    Made with DTensor's own constructor from ``original``'s spec, not ``DTensor.from_local``: that
    moves the local tensor to the mesh's device (a CUDA mesh: a new GPU tensor), and the writer
    thread's later copy into ``local`` would then never reach what DCP writes. torch's own stager
    (``_create_cpu_state_dict``) keeps the CPU tensor the same way, by setting ``_local_tensor``."""
    if not hasattr(original, "placements"):
        return local
    dtensor: Any = original
    staged: torch.Tensor = type(dtensor)(local, dtensor._spec, requires_grad=False)
    return staged


def _rank_state(trainer: BaseTrainer) -> dict[str, Any]:
    """What each rank contributes to a checkpoint: its random streams, data position, skip count."""
    return {"rng": rng.capture(), "data": trainer.data_state(), "loss_none_skips": trainer.loss_none_skips}


def _with_hooks(state: dict[str, Any], **parts: Any) -> dict[str, Any]:
    """``parts`` (file stem -> object), plus ``hooks`` when ``state`` holds hook state."""
    extra = {key: value for key, value in state.items() if key not in MODEL_KEYS + TRAINING_KEYS}
    return {**parts, "hooks": extra} if extra else parts


def _check_ranks_in_step(ranks: list[dict[str, Any]], step: int) -> None:
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


def _gather(state: dict[str, Any], world_size: int, group: Any = None) -> list[dict[str, Any]]:
    """Every rank's ``state``, on every rank (one collective per checkpoint; ``group`` None: the
    default group)."""
    if world_size == 1:
        return [state]
    import torch.distributed as dist

    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, state, group=group)
    return states


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _from_rank0(value: Any, world_size: int, group: Any = None) -> Any:
    """Rank 0's ``value``, on every rank (a decision all must share)."""
    if world_size == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


@contextlib.contextmanager
def _state_dict_options(trainer: BaseTrainer, options: Any) -> Iterator[None]:
    """``trainer.state_dict()`` / ``load_state_dict()`` with ``options`` (a sharded save or load uses
    each rank's shards, whatever the trainer's own options say), then the trainer's own again."""
    saved = trainer.state_dict_options
    trainer.state_dict_options = options
    try:
        yield
    finally:
        trainer.state_dict_options = saved


def _refuse_sharded(model_state: dict[str, Any]) -> None:
    """Rank 0 writes a full checkpoint alone: a model state split over ranks would save rank 0's
    shards only, and a resume would load them into every rank's shard."""
    from trainfsm.sharded import is_sharded

    for key, value in model_state.items():
        if is_sharded(value):
            raise _refusal(key, f" ({type(value).__name__} {value.placements})")


def _refusal(key: str, what: str = "") -> CheckpointError:
    return CheckpointError(
        f"model state {key!r} is sharded over ranks{what}, but CheckpointingHook(sharded=False) writes "
        f"rank 0's state only; pass sharded='auto' (the default) or True to have every rank write its "
        f"shards with torch.distributed.checkpoint, or the trainer state_dict_options="
        f"StateDictOptions(full_state_dict=True, cpu_offload=True) "
        f"(torch.distributed.checkpoint.state_dict) to save the whole model from rank 0."
    )
