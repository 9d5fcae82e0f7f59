"""``BaseTrainer``: the user's contract and ``train()``, which drives the machine.

What each state does is a function of ``trainfsm.states`` (the table in ``_drive``): it does its
state's work and returns the trigger to fire next; ``train()`` alternates the two until EXIT.
Hook methods are called by the dispatcher (``trainfsm.run.Hooks``), from those functions and
from the state entries the trainer binds; the audit events are recorded by the machine's
transitions. What a run needs while it runs is in ``trainfsm.run.Run``; preemption in
``trainfsm.preemption``; the data position in ``trainfsm.data_cursor.DataCursor``; the tensor work
of a step in ``trainfsm.step.Stepper``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainfsm import machine as fsm
from trainfsm import options as check
from trainfsm import resume, states
from trainfsm.collectives import LossNoneWarning
from trainfsm.data_cursor import DataCursor
from trainfsm.hooks.base import BaseHook
from trainfsm.machine import ExitReason
from trainfsm.preemption.policy import ExitPolicy, Preemption, exit_policy
from trainfsm.preemption.signals import hold_interrupt, release_interrupt
from trainfsm.run import Hooks, Run, open_trail, start_watchdog
from trainfsm.step_info import StepInfo
from trainfsm.torch_workarounds import import_collectives_before_any_group
from trainfsm.utils import unwrap

if TYPE_CHECKING:
    import signal

    from trainfsm.preemption.slurm import SlurmJob

import_collectives_before_any_group()  # a script imports us before it creates its group (see there)

__all__ = ["BaseTrainer", "LossNoneWarning"]


class BaseTrainer(fsm.Triggers):
    """Subclass it, implement ``build_data_loader``, ``build_model``, ``build_optimizer`` and
    ``forward``, then call ``train()``.

    Methods you implement (each is described with its signature below): BUILD calls the
    ``build_*`` methods once, in this order, when ``train()`` starts; ``forward`` runs once per
    micro-batch.

    | method | returns | if you don't override it |
    |---|---|---|
    | ``build_data_loader()`` | any iterable of training batches | required |
    | ``build_model()`` | the ``nn.Module``, on ``self.device`` (wrapped for DDP/FSDP if you like) | required |
    | ``build_optimizer()`` | a ``torch.optim.Optimizer`` over ``self.model``'s parameters | required |
    | ``build_lr_scheduler()`` | an LR scheduler, stepped once per applied optimizer step | no scheduler |
    | ``build_grad_scaler()`` | a ``torch.amp.GradScaler`` | enabled for ``mixed_precision="fp16"`` only |
    | ``build_hooks()`` | a list of hooks (``BaseHook``) | no hooks |
    | ``forward(input)`` | ``(loss, records)`` for one batch | required |

    Attributes you read (from a hook, ``forward`` or after ``train()``):

    - ``step`` (``int``): the optimizer step; from STEP on, the step being run (1 for the first),
      after it the last one completed. A resumed run counts on from its checkpoint.
    - ``epoch`` (``int``): the data epoch, 0-based.
    - ``step_info`` (``StepInfo``): the current step's figures (``loss``, ``grad_norm``,
      ``records``, ...), complete when the step's optimizer step was applied.
    - ``state`` (``str``): the machine's current state (``"ACCUMULATE"``, ...), once ``train()``
      started.
    - ``exit_reason`` (``ExitReason | None``) and ``exit_code`` (``int | None``): why the run took
      EXIT and the status it exits with; None until then.
    - ``data_loader``, ``model``, ``optimizer``, ``lr_scheduler``, ``grad_scaler``, ``hooks``:
      what the ``build_*`` methods returned; None (``hooks``: empty) until BUILD ran.
      ``unwrapped_model`` is ``model`` without its wrappers (DDP, FSDP, ``torch.compile``, ...).
    - ``rank``, ``world_size`` (``int``): this process's rank and the number of ranks (0 and 1
      without a process group); ``run_id`` (``str``) and ``attempt`` (``int``, 0 for the first
      launch) name the run in its audit trail; ``slurm`` (``SlurmJob | None``) is the SLURM job
      it runs in. All known once ``train()`` started.
    - ``events``: the audit trail's logger, once ``train()`` started:
      ``trainer.events.info("name", **fields)`` records an event.
    - ``loss_none_skips`` (``int``): micro-batches skipped for ``loss=None`` in this launch.
    - Each constructor argument under its own name, as checked: ``workspace`` is a ``Path`` (or
      None), ``device`` a ``torch.device``, ``gradient_accumulation_steps`` an ``int``.

    Arguments (each is checked at construction; a bad value names the argument and what it takes):

    - ``max_steps``: optimizer steps in all; the run completes there (a resumed run counts on).
    - ``grad_clip``: clip the gradients' 2-norm to this (``step_info["grad_norm"]`` is the norm
      before clipping); None: no clipping.
    - ``max_non_finite_grad_retries``: a step whose gradients are not finite is retried on fresh
      batches up to this many times (RETRY), then the run fails; None or 0: fail at once (with the
      fp16 grad scaler, its skip-and-rescale applies instead).
    - ``max_oom_retries``: how many times over the run a ``torch.OutOfMemoryError`` in a micro-batch's
      forward or backward may halve the micro-batches (RETRY by ``oom``: the step again from its first
      micro-batch, each split in two along dimension 0, losses weighted so the step averages the same
      samples; the split stays for the rest of the run, ``trainfsm.oom``). 0 (default): an out-of-memory
      error ends the run, as splitting changes losses whose samples meet (BatchNorm, in-batch negatives).
    - ``mixed_precision``: None, ``"bf16"`` or ``"fp16"`` (autocast; fp16 with a grad scaler).
    - ``gradient_accumulation_steps``: micro-batches per optimizer step (default 1).
    - ``global_batch_size``: samples per optimizer step over all ranks, kept at any world size:
      BUILD sets ``gradient_accumulation_steps`` to it / (world size x the data loader's
      ``batch_size``), an error when that is not whole (or contradicts a
      ``gradient_accumulation_steps`` given too). Over a ``DistributedSampler``, each epoch then
      ends at its last full global batch, so that a run resumed on another number of ranks
      trains each sample once (``trainfsm.data_order``). None (default): not stated.
    - ``workspace``: the run's directory: the audit trail (``logs/``), checkpoints and other
      hooks' files go under it; None: the trail goes to the console only.
    - ``device``: where the model runs (default: CUDA when available, else CPU).
    - ``no_sync_accumulate``: skip the gradient all-reduce on all but a step's last micro-batch
      (DDP's ``no_sync``), default True.
    - ``state_dict_options``: torch's ``StateDictOptions`` for ``state_dict()`` (FSDP: full or
      sharded state).
    - ``logger``: the stdlib logger people read the events through (default
      ``logging.getLogger("trainfsm")``).
    - ``max_epochs``: also end the run when the data runs out this many times; None: loop over
      the data until ``max_steps``.
    - ``loss_none_agreement``: with several ranks, agree before every backward whether some rank's
      loss is None, so one rank may skip alone (one small all-reduce per micro-batch).
    - ``trail_form``: ``"compact"`` (routine steps as ``steps`` records) or ``"full"`` (every
      transition verbatim, for debugging the trail).
    - ``stall_timeout``: the stall watchdog's budget: ``"auto"`` (default: learned from the run's
      own steps and saves, ``trainfsm.watchdog``), seconds without a transition in any state, or
      None (no watchdog). A rank past its budget writes a ``stall`` event saying where it is and
      what it waits in.
    - ``stall_action``: ``"record"`` (default: record the stall and keep waiting) or ``"exit"``
      (record it, requeue under SLURM, and end the process with status 75 and exit reason
      ``stalled``, so torchrun's restarts or the requeued job resume from the newest checkpoint;
      not requeued when the same stall, same state and step, ended the attempt before).
    - ``job_end_margin``: under SLURM with a time limit, leave by the preemption's path (agree,
      save, requeue, exit ``128 + signal``; the trail's ``deadline``) once the time left no longer
      covers the next step, a save, the exit and this margin: ``"auto"`` (default:
      ``trainfsm.preemption.deadline``), seconds, or None (SLURM's own limit ends the job).
      Outside SLURM it changes nothing.
    """

    def __init__(
        self,
        max_steps: int,
        grad_clip: float | None = None,
        max_non_finite_grad_retries: int | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        global_batch_size: int | None = None,
        workspace: Path | str | None = None,
        device: torch.device | str | int | None = None,
        no_sync_accumulate: bool = True,
        state_dict_options: Any = None,
        logger: Any = None,
        max_epochs: int | None = None,
        loss_none_agreement: bool = False,
        trail_form: str = "compact",
        stall_timeout: float | str | None = "auto",
        stall_action: str = "record",
        job_end_margin: float | str | None = "auto",
        max_oom_retries: int | None = 0,
    ) -> None:
        self.max_steps: int = check.positive_int("max_steps", max_steps)  # type: ignore[assignment]
        self.grad_clip = check.grad_clip(grad_clip)
        self.max_non_finite_grad_retries: int = check.count("max_non_finite_grad_retries", max_non_finite_grad_retries)
        self.mixed_precision = check.mixed_precision(mixed_precision)
        self.gradient_accumulation_steps: int = check.count(
            "gradient_accumulation_steps", gradient_accumulation_steps, 1
        )
        self.global_batch_size = check.positive_int("global_batch_size", global_batch_size, allow_none=True)
        self._accumulation_given = gradient_accumulation_steps is not None
        self.workspace = check.workspace(workspace)
        self.device = check.device(device)
        self.no_sync_accumulate = check.boolean("no_sync_accumulate", no_sync_accumulate)
        self.state_dict_options = check.state_dict_options(state_dict_options)
        self.logger = check.logger(logger)
        self.max_epochs = check.positive_int("max_epochs", max_epochs, allow_none=True)
        self.loss_none_agreement = check.boolean("loss_none_agreement", loss_none_agreement)
        self.trail_form = check.trail_form(trail_form)
        self.stall_timeout = check.stall_timeout(stall_timeout)
        self.stall_action = check.stall_action(stall_action)
        self.job_end_margin = check.job_end_margin(job_end_margin)
        self.max_oom_retries = check.count("max_oom_retries", max_oom_retries)
        #: Micro-batches this rank skipped for loss=None in this launch (with loss_none_agreement,
        #: also those another rank returned None for): checkpoints compare the ranks' counts.
        self.loss_none_skips = 0

        # The trainer's own resumable state: the completed step count and the data position.
        self.step = 0
        self._data = DataCursor()  # ``epoch`` is the cursor's
        self.step_info = StepInfo()
        self.exit_reason: ExitReason | None = None
        self.exit_code: int | None = None
        self.data_loader: Iterable[Any] | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.grad_scaler: torch.amp.GradScaler | None = None
        self.hooks: list[BaseHook] = []
        self.exit_policy: ExitPolicy | None = None
        # Known once train() opened the trail (trainfsm.run.open_trail).
        self.rank, self.world_size = 0, 1
        self.run_id: str | None = None
        self.attempt = 0
        self.events: Any = None  # the trail's logger: self.events.info("name", **fields)
        self.slurm: SlurmJob | None = None
        self._run: Run | None = None  # everything that exists only while train() runs
        self._trained = False

    # ---------------------------------------------------------------- the user's contract
    def build_data_loader(self) -> Iterable[Any]:
        """Required: the training batches, any iterable (a ``DataLoader``, a list, ...); each item
        is one micro-batch's ``forward(input)``. With several ranks, each rank's share."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_data_loader()")

    def build_model(self) -> nn.Module:
        """Required: the model, on ``self.device``; wrap it for DDP or FSDP here
        (``trainfsm.distributed.wrap_model``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def build_optimizer(self) -> torch.optim.Optimizer:
        """Required: the optimizer over ``self.model``'s parameters (built after the model)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_optimizer()")

    def build_lr_scheduler(self) -> Any:
        """Optional: an LR scheduler over ``self.optimizer``, stepped once per applied optimizer
        step (not on a skipped fp16 step). Default: None, no scheduler."""
        return None

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        """Optional: the ``torch.amp.GradScaler``. Default: one enabled only for
        ``mixed_precision="fp16"``."""
        return torch.amp.GradScaler(self.device.type, enabled=self.mixed_precision == "fp16")

    def build_hooks(self) -> list[BaseHook]:
        """Optional: the hooks (checkpoints, logging, validation, ...), run in this order. Default:
        none."""
        return []

    def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Required: one micro-batch. Returns ``(loss, records)``: the loss to backpropagate (or
        None to skip the micro-batch) and a dict of figures for ``step_info["records"]`` (tensors
        are fine: nothing is read from the device per step)."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(input)")

    def set_exit_signals(
        self,
        signals: Iterable[int | signal.Signals] | int | signal.Signals,
        exit_code: int | str = "128+signal",
        exit_wait: float | Any = 0.0,
        requeue: bool | str = "auto",
        max_requeues: int | None = None,
    ) -> None:
        """Exit cleanly on these signals, for runs that do not use ``CheckpointingHook``'s (or want
        them from the very start of BUILD). Handlers are installed by ``train()``, not here."""
        self.exit_policy = exit_policy("set_exit_signals()", signals, exit_code, exit_wait, requeue, max_requeues)

    @property
    def exit_pending(self) -> bool:
        """Whether an exit signal (or the job's end) has come on this rank and the run is about to
        leave: long work in a hook's RESTORE (``CheckpointingHook``'s reservation of the first
        saves' room) may stop early, since the run goes to EXIT at RESTORE's end. False before
        ``train()``."""
        run = self._run
        return run is not None and bool(run.preemption.watcher.pending)

    # ---------------------------------------------------------------- driving the machine
    def train(self) -> None:
        """Run BUILD -> RESTORE -> steps -> EXIT. Exceptions take ``fail`` to EXIT, then re-raise."""
        if self._trained:
            raise RuntimeError("train() was already called on this trainer; build a new trainer to train again.")
        self._trained = True
        preemption = Preemption(self.exit_policy, self)  # first of all: no exit signal is lost from here on
        try:
            self._drive(preemption)
        finally:
            preemption.stop()

    def _drive(self, preemption: Preemption) -> None:
        machine = fsm.build_machine(self)
        event_log, logs = open_trail(self, preemption)
        # A Ctrl-C that is not an exit signal raises KeyboardInterrupt wherever it lands: held
        # until the machine below can record it (a failure, its transition and exit).
        held = hold_interrupt()
        try:
            run = self._run = Run(machine, event_log, preemption, logs, Hooks(self, []))
            # The trainer's own bookkeeping is bound (and the machine compiled) before any user code
            # runs, so that a failure in BUILD is recorded like any other: transition, exception, exit.
            finish_exit = partial(states.finish_exit, self, run)  # EXIT's own work, after the hooks'
            fsm.bind(machine, "enter", fsm.STEP, partial(states.begin_step, self, run))
            fsm.bind(machine, "enter", fsm.EXIT, lambda: run.hooks.after_train(run.failed))  # the built hooks
            fsm.bind(machine, "enter", fsm.EXIT, finish_exit)
            machine.compile_events(self, event_log.transition_recorder)
            run.watchdog = start_watchdog(self, machine.progress, run)
        except BaseException:
            release_interrupt(held)
            raise
        # What each state does, returning the trigger that leaves it (None: EXIT, the end).
        work: dict[str, Callable[[], Callable[[], bool] | None]] = {
            fsm.BUILD: partial(states.build, self, run, finish_exit),
            fsm.RESTORE: partial(states.restore, self, run),
            fsm.STEP: lambda: self.micro,  # STEP's work is its entry's (``states.begin_step``): on to a micro-batch
            fsm.ACCUMULATE: partial(states.accumulate, self, run),
            fsm.RETRY: partial(states.retry, self, run),
            fsm.CHECKPOINT: partial(states.checkpoint, self, run),
            fsm.EXIT: lambda: None,
        }
        try:
            release_interrupt(held)  # a Ctrl-C held since the trail opened is raised here, and recorded
            trigger = work[self.state]()
            while trigger is not None:
                trigger()
                trigger = work[self.state]()
        except BaseException as exc:
            run.record_failure(self, exc)
            raise
        finally:
            run.close(preempted=self.exit_reason is ExitReason.PREEMPTED)
        if self.exit_reason is ExitReason.PREEMPTED:
            raise SystemExit(self.exit_code)
        if run.exit_errors:  # EXIT's work failed after training completed: recorded, now raised
            raise run.exit_errors[0]

    # ---------------------------------------------------------------- data
    @property
    def epoch(self) -> int:
        """The data epoch (0-based); saved in checkpoints with ``step``."""
        return self._data.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._data.epoch = value

    # ---------------------------------------------------------------- state and helpers
    def state_dict(self, options: Any = None) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler, the trainer's own state, and each hook's
        ``on_state_dict``. The trainer's own: ``step``, ``epoch``, and ``rank_state``, this rank's
        random streams, data position and loss=None skip count (a checkpoint keeps every rank's).
        ``options``: torch's ``StateDictOptions`` for this call, else ``state_dict_options``."""
        return resume.capture(self, options, self._data, self._hooks())

    def load_state_dict(self, state: dict[str, Any], options: Any = None, data_resume: str = "auto") -> None:
        """The inverse of ``state_dict``. A ``rank_state`` entry puts the random streams back and
        has RESTORE position the data iterator as ``data_resume`` says (``trainfsm.data_state``;
        "none": a fresh iterator); one made for another world size (``data_order.other_size``)
        continues the saving run's global position (``CheckpointingHook(data_reshard=...)``)."""
        resume.restore(self, options, self._data, state, data_resume, self._hooks())

    def unwrap(self, model: nn.Module) -> nn.Module:
        """``model`` without its wrappers: ``torch.compile``, DDP, FSDP, ... (``trainfsm.unwrap``)."""
        return unwrap(model)

    @property
    def unwrapped_model(self) -> nn.Module:
        """``self.model`` without its wrappers (``unwrap``); available once BUILD built it."""
        if self.model is None:
            raise RuntimeError("unwrapped_model is available once build_model() ran (after train() starts).")
        return unwrap(self.model)

    def log(self, records: dict[str, Any], dry_run: bool = False) -> None:
        """Pass figures to every hook's ``on_log`` (W&B, TensorBoard, ...). Also ``log_scalars``."""
        self._hooks().log(records, dry_run)

    log_scalars = log  # the other published spelling

    def log_images(self, records: dict[str, Any], dry_run: bool = False) -> None:
        """Pass images to every hook's ``on_log_images``."""
        self._hooks().log_images(records, dry_run)

    def _hooks(self) -> Hooks:
        """The dispatcher of the built hooks; outside ``train()``, one over ``self.hooks``."""
        run = self._run
        return run.hooks if run is not None else Hooks(self, self.hooks)
