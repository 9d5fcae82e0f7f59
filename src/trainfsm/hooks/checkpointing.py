"""``CheckpointingHook``: saves in CHECKPOINT, loads in RESTORE, through ``CheckpointStore``.

The hook decides when and what; the work is in ``trainfsm.checkpoint``: ``restore`` (which
checkpoint loads, and how its state gets back), ``save`` (what a checkpoint holds and which rank
writes what), ``background`` (staging and the background writer of ``async_save=True``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainfsm import collectives, data_order, data_state
from trainfsm.checkpoint.background import BackgroundSaves
from trainfsm.checkpoint.io import check_checksum
from trainfsm.checkpoint.restore import (
    model_shapes,
    open_store,
    refuse_foreign_ahead,
    reserve_room,
    restore,
    start_timeline,
)
from trainfsm.checkpoint.save import Saver, SaveResult, log_saved, saves_sharded
from trainfsm.checkpoint.store import CheckpointStore
from trainfsm.checkpoint.writemode import check_direct_io
from trainfsm.hooks.base import BaseHook
from trainfsm.machine import ExitReason
from trainfsm.options import int_at_least
from trainfsm.preemption.policy import DEFAULT_EXIT_SIGNALS, exit_policy

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer


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
    ``data_reshard`` says what a resume on another number of ranks does when it cannot continue
    the data with each sample trained once (``trainfsm.data_order``: it can for a ``DataLoader``
    over a ``DistributedSampler`` whose global position divides by the new size): ``"exact"``
    (default) stops in RESTORE with the reason; ``"approximate"`` goes on (from the position
    rounded down, or each new rank from old rank ``rank mod old size``'s own) and the trail's
    ``data_resumed`` records why it is not exact.
    ``async_save`` stages the state to CPU memory and writes it on a background thread while
    training goes on: at most one save in flight, a failure raises at the next step or at EXIT, and
    EXIT waits until the last save is durable (the job's end under SLURM plans for that wait, with
    the writes' times as the writer thread measured them). The CPU copy is kept from one save to
    the next, which copies into it again (one copy of the state stays in host memory from the first
    save on).

    ``sharded`` says how a model state split over ranks (FSDP2 ``fully_shard`` with the default
    ``state_dict_options``) is saved: ``"auto"`` (default) writes a sharded checkpoint exactly then,
    and a full one from rank 0 otherwise; ``True`` always writes sharded checkpoints; ``False``
    always writes from rank 0 and refuses a sharded state. In a sharded checkpoint every rank
    writes its own shards of the model and optimizer with ``torch.distributed.checkpoint`` into the
    one temporary directory rank 0 made; the checkpoint is complete (manifest, rename, ``latest``)
    only once every rank's files are durable, so the ranks must share one filesystem. Loading
    follows the checkpoint, whatever ``sharded`` says; a sharded one loads on any world size (DCP
    reshards). With ``async_save`` every rank copies its shards to CPU memory and writes them on its
    background thread, over a gloo process group the hook makes for that in RESTORE (so a
    sharded ``async_save`` needs every rank to save at the same steps, as it does anyway); a
    failed sharded save raises on every rank at the next checkpoint or at EXIT.

    ``checksum``: what the manifest lists for every file (one sum per file), ``"xxh3_128"`` (default: fast;
    it guards against torn writes, bit rot and truncation, which is what a checksum stored beside the
    data can do) or ``"sha256"``. Loading verifies with whichever one a checkpoint's manifest names.

    ``direct_io``: how checkpoint files reach the disk. ``"auto"`` (default) measures both ways on
    the checkpoint's file system and uses the faster, per file by its size: a probe of 128 MiB in
    RESTORE decides a file of a size not saved yet, the rates of saved files of its size the later
    ones (a file tries the other way when its size's rate is below that way's probe), re-checked
    every ten minutes. ``False`` forces the page cache, each 4 MiB's
    writeback started as soon as it is written and the pages dropped after the fsync; ``True``
    forces ``O_DIRECT`` (past the page cache). Where the file system refuses ``O_DIRECT`` the files go
    through the page cache. ``checkpoint_store_ready`` and ``checkpoint_saved`` record the choice,
    why, and the measured rates (see ``trainfsm.checkpoint.writemode``; ``benchmarks/checkpoint.py``
    measures both ways).

    Other hooks keep pointers beside ``latest`` (``EarlyStoppingHook``: ``best``) through
    ``point_when_saved`` and ``point_to_loaded``; pruning never deletes a pointer's target.
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
        direct_io: bool | Literal["auto"] = "auto",
        checksum: Literal["xxh3_128", "sha256"] = "xxh3_128",
        data_reshard: Literal["exact", "approximate"] = "exact",
    ) -> None:
        self.interval = int_at_least("CheckpointingHook interval", interval, 1)
        self.keep_previous = int_at_least("CheckpointingHook keep_previous", keep_previous, 0)
        self.keep_interval = int_at_least("CheckpointingHook keep_interval", keep_interval, 0)
        steps = () if keep_steps is None else keep_steps
        self.keep_steps = frozenset(int_at_least("CheckpointingHook keep_steps", step, 1) for step in steps)
        _check_paths(path, load)
        self.path, self.load = Path(path), load
        self.exit_policy = exit_policy(
            "CheckpointingHook",
            list(DEFAULT_EXIT_SIGNALS) if exit_signals is None else exit_signals,
            exit_code,
            exit_wait,
            requeue=requeue,
            max_requeues=max_requeues,
        )
        self.exit_signals = self.exit_policy.signals
        self.exit_code = self.exit_policy.code
        self.exit_wait = self.exit_policy.wait
        _check_modes(data_resume, sharded, direct_io)
        self.data_resume, self.sharded, self.direct_io = data_resume, sharded, direct_io
        if data_reshard not in data_order.RESHARD_MODES:
            raise ValueError(
                f"CheckpointingHook data_reshard must be one of {data_order.RESHARD_MODES}; got {data_reshard!r}."
            )
        self.data_reshard = data_reshard
        self.async_save = async_save
        self.saves_sharded = False  # decided in RESTORE, from the model and the trainer's options
        self.store: CheckpointStore | None = None
        self.loaded_from: Path | None = None
        self._step_in_store: int | None = None  # the step last saved or loaded: never written twice
        self._saver: Saver | None = None  # made in RESTORE, with the store
        self._background: BackgroundSaves[SaveResult] = BackgroundSaves()
        self.background_writes = self._background.times if async_save else None
        self.checksum = check_checksum("CheckpointingHook", checksum)

    # ------------------------------------------------------------------ RESTORE
    def on_enter_restore(self, trainer: BaseTrainer) -> None:
        self.store = store = open_store(trainer, self._root(trainer), direct_io=self.direct_io, checksum=self.checksum)
        self._saver = Saver(store, self.keep_previous, self.checksum, self._background if self.async_save else None)
        current = model_shapes(trainer)
        self.saves_sharded = saves_sharded(trainer, current, self.sharded)
        if self.load is not None:
            loaded = restore(trainer, store, self.load, self.data_resume, current, self.data_reshard)
            if loaded is not None:
                self.loaded_from = loaded
                self._step_in_store = trainer.step
        else:  # a fresh start asked for: the data ledger does not count it as lost work
            trainer.events.info("checkpoint_not_loaded", reason="load=None")
        start_timeline(trainer, store, self.load)
        refuse_foreign_ahead(trainer, store)
        if trainer.rank == 0 and not self.saves_sharded:
            reserve_room(trainer, store, current, copies=self.keep_previous + 2)
        if self.async_save:  # its thread (and group) and CPU buffers now, not in the first save
            self._background.start(trainer.world_size, self.saves_sharded)
            self._background.prestage(trainer, self.saves_sharded)

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
        self._log_finished_save(trainer, wait=True)  # at most one save in flight
        if trainer.step == self._step_in_store:
            # Only ``exhausted`` (max_epochs) comes here for a step already saved or loaded.
            return
        self._step_in_store = trainer.step
        if self._saver is None:
            raise RuntimeError("CheckpointingHook saves in CHECKPOINT only after RESTORE opened its store")
        self._saver.save(trainer, keep=self._kept(trainer.step), sharded=self.saves_sharded)

    # ------------------------------------------------------------------ asynchronous saves
    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        """The first in-place update of parameters or optimizer state must wait for the copy."""
        self._background.wait_staged()

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if self._background.in_flight:
            self._log_finished_save(trainer, wait=False)

    def _log_finished_save(self, trainer: BaseTrainer, wait: bool) -> None:
        """Log a finished asynchronous save; with ``wait``, wait for it; raise for a failed one
        (see ``BackgroundSaves.settle``)."""
        settled = self._background.settle(trainer, wait)
        if settled is not None:
            (saved, world), blocked = settled
            if saved is not None:
                log_saved(trainer, saved, blocked=blocked, world=world)

    def on_after_train(self, trainer: BaseTrainer) -> None:
        """EXIT waits until the last save is durable, then releases the I/O threads."""
        try:
            self._log_finished_save(trainer, wait=True)
        finally:
            self._background.close()
            if self.store is not None:
                self.store.close()
            # A failing rank may never arrive at the barrier.
            if trainer.exit_reason not in (ExitReason.FAILED, ExitReason.INTERRUPTED):
                collectives.barrier()

    # ------------------------------------------------------------------ pointers, for other hooks
    def point_when_saved(self, pointer: str, step: int) -> None:
        """Have ``pointer`` (a name such as ``"best"``) name the first checkpoint saved at ``step`` or
        later, moved as part of that save: right after ``latest`` and before pruning, on the thread
        that writes it (an asynchronous save's too), so its target is protected from the start.

        Call it from RESTORE on (the store is open), before that save begins; a later call for the
        same pointer replaces an earlier one. Ask for the checkpoint itself with ``wants_checkpoint``.
        """
        if self.store is None:
            raise RuntimeError("CheckpointingHook points at checkpoints only after RESTORE opened its store")
        self.store.point_when_saved(pointer, step)

    def point_to_loaded(self, trainer: BaseTrainer, pointer: str) -> None:
        """Make ``pointer`` name the checkpoint this run resumed from, now. Done by rank 0, which
        writes the store; nothing on the other ranks, when no checkpoint was loaded, or when it was
        loaded from outside this hook's directory (``load=`` a path elsewhere)."""
        store, loaded = self.store, self.loaded_from
        if store is not None and loaded is not None and loaded.parent == store.root and trainer.rank == 0:
            store.point(pointer, loaded.name)

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


def _check_paths(path: Any, load: Any) -> None:
    if not isinstance(path, (str, Path)) or str(path) == "":
        raise TypeError(f"CheckpointingHook path must be a non-empty str or Path; got {path!r}.")
    if load is not None and not isinstance(load, (str, Path)):
        raise TypeError(f"CheckpointingHook load must be 'latest', a path or None; got {load!r}.")


def _check_modes(data_resume: Any, sharded: Any, direct_io: Any) -> None:
    if data_resume not in data_state.MODES:
        raise ValueError(f"CheckpointingHook data_resume must be one of {data_state.MODES}; got {data_resume!r}.")
    if not (isinstance(sharded, bool) or (isinstance(sharded, str) and sharded == "auto")):
        raise ValueError(
            f"CheckpointingHook sharded must be True, False or 'auto' (sharded exactly when the model "
            f"state is split over ranks); got {sharded!r}."
        )
    check_direct_io("CheckpointingHook", direct_io)
