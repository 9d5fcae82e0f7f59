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
    """Save every ``interval`` steps (and at the end), keep the newest ``keep_previous + 1`` plus
    every kept one, resume from ``load``, and on an exit signal finish the step, checkpoint and exit.

    Arguments:

    - ``interval`` (required): save after every ``interval``-th optimizer step, and at the run's
      last step (completed, stopped or preempted).
    - ``keep_previous`` (default 0): how many checkpoints to keep besides the newest; older ones
      are pruned after each save (their large files written over by the next save).
    - ``keep_interval`` (default 0: none): also keep, never pruned, every checkpoint whose step is a
      multiple of this.
    - ``keep_steps`` (default None: none): also keep the checkpoints of these steps (each is saved
      at that step even off the interval).
    - ``path`` (default ``"checkpoints"``): the checkpoint directory. A relative path is under the
      trainer's ``workspace`` (``WORKSPACE/checkpoints``; one that already starts with the
      workspace is taken as it is); an absolute path is used as it is. A relative path with no
      workspace is an error.
    - ``load`` (default ``"latest"``): what RESTORE loads. ``"latest"``: the newest complete
      checkpoint under ``path`` that verifies (trainfsm's or trainloop's; a corrupt one is skipped
      with a ``checkpoint_skipped`` event), or a fresh start when there is none: the setting for a
      script that is requeued. A name or path (``"1000"``, ``"best"``, relative names first under
      ``path``): that checkpoint, which must exist and verify; newer checkpoints are then abandoned
      once the run saves. None: start from step 0 and load nothing, even where checkpoints exist
      (they are abandoned, never pruned, once the run saves).
    - ``exit_signals`` (default None: SIGTERM and SIGUSR1, what schedulers send before a kill; ``[]``:
      none): the signals that end the run by checkpointing. The current optimizer step finishes,
      the ranks agree on a step, the checkpoint is saved, then the process exits. trainloop's hook
      handles none by default; this one makes a run preemption-safe without asking.
    - ``exit_code`` (default ``"128+signal"``: 138 for SIGUSR1, 143 for SIGTERM): the status of
      that exit, or an int.
    - ``exit_wait`` (default 0.0): seconds (or a ``timedelta``) to wait after the checkpoint before
      exiting.
    - ``data_resume`` (default ``"auto"``): how the data iterator gets back to where it was:
      ``"state"`` (the loader's ``state_dict()``), ``"sampler"`` (a map-style ``DataLoader``: the used
      indices are skipped), ``"skip"`` (the used batches are drawn again and dropped), ``"none"`` (a
      fresh iterator), or ``"auto"``, the best of these the loader allows (``trainfsm.data_state``).
    - ``async_save`` (default False): stage the state to CPU memory and write it on a background
      thread while training goes on: at most one save in flight, a failure raises at the next step
      or at EXIT, and EXIT waits until the last save is durable. The CPU copy is kept from one save
      to the next (one copy of the state stays in host memory from the first save on).
    - ``requeue`` (default ``"auto"``: inside a SLURM batch job): after an exit signal's checkpoint
      is durable, rank 0 runs ``scontrol requeue`` so the job runs again and resumes; False never.
    - ``max_requeues`` (default None: no cap): requeue only while ``SLURM_RESTART_COUNT`` is below it.
    - ``sharded`` (default ``"auto"``): how a model state split over ranks (FSDP2 ``fully_shard``
      with the default ``state_dict_options``) is saved. ``"auto"`` writes a sharded checkpoint
      exactly then and a full one from rank 0 otherwise; True always sharded; False always from
      rank 0, refusing a sharded state. In a sharded checkpoint every rank writes its own shards
      with ``torch.distributed.checkpoint`` into one directory, complete only once every rank's
      files are durable, so the ranks must share one file system; it loads on any world size.
      A sharded ``async_save`` writes over a gloo group the hook makes in RESTORE. Loading follows
      the checkpoint, whatever ``sharded`` says.
    - ``direct_io`` (default ``"auto"``): how files reach the disk. ``"auto"`` measures both ways on
      the checkpoint's file system (a probe of 32 MiB files in RESTORE, then the saves' own rates
      per file size, re-checked every ten minutes) and uses the faster; False forces the page
      cache, True ``O_DIRECT``. Where the file system refuses ``O_DIRECT`` the files go through the
      page cache. ``checkpoint_saved`` records the choice and the rates
      (``trainfsm.checkpoint.writemode``).
    - ``checksum`` (default ``"xxh3_128"``: fast; it guards against torn writes, bit rot and
      truncation) or ``"sha256"``: the sum the manifest lists for every file. Loading verifies with
      whichever one a checkpoint's manifest names.
    - ``data_reshard`` (default ``"exact"``): what a resume on another number of ranks does when it
      cannot continue the data with each sample trained once (it can for a ``DataLoader`` over a
      ``DistributedSampler`` whose global position divides by the new size): ``"exact"`` stops in
      RESTORE with the reason; ``"approximate"`` goes on (from the position rounded down, or each
      new rank from old rank ``rank mod old size``'s own) and the trail's ``data_resumed`` says why
      it is not exact (``trainfsm.data_order``).

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
