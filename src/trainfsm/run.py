"""One call of ``train()``: the state its machine's states share, the hook dispatcher, and the
trail's first record.

``BaseTrainer`` keeps what the user configured and what users' code reads (``step``,
``step_info``, ``exit_reason``, the built components); everything that exists only while
``train()`` runs lives in one ``Run``, created by ``train()``, so no attribute appears on the
trainer after ``__init__``.

``Hooks`` is where every hook method is called: one method per event, each calling only the hooks
that override it, in the order of ``build_hooks()``. When each event happens:

=========================  =====================================================================
``before_train``           RESTORE is done (resumed or fresh), just before ``restored`` (or
                           ``finish`` when the checkpoint is already at ``max_steps``)
``before_step``            entering STEP, once ``trainer.step`` is the step about to run
``before_optimizer_step``  a step's last micro-batch: after unscale and clip, before ``optimizer.step()``
``evaluate``               after the optimizer step, before anything is decided
``step_info``              then every hook adds its figures of the step to ``trainer.step_info``
``stop_wanted``            then: does a hook end the run (``wants_stop``: ``stopped``)?
``checkpoint_wanted``      then, with ``trainer.exit_reason`` decided: does a hook want CHECKPOINT?
``after_step``             last, just before ACCUMULATE is left by ``stepped``, ``save`` or ``finish``
``after_train``            entering EXIT, however the run ends; a failing hook does not stop the others
``state_dict``             inside ``trainer.state_dict()`` / ``load_state_dict()``
``log``, ``log_images``    inside ``trainer.log()`` / ``log_images()``
=========================  =====================================================================

A hook's ``on_enter_<state>`` / ``on_exit_<state>`` methods are bound to the machine's states
(``bind_states``), after the dispatcher's own work on that state's entry.
"""

from __future__ import annotations

import contextlib
import platform
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainfsm import activity, collectives
from trainfsm import machine as fsm
from trainfsm.collectives import failed_collective
from trainfsm.hooks.base import BaseHook, overrides
from trainfsm.machine import ExitReason
from trainfsm.preemption import slurm, torchelastic
from trainfsm.preemption.deadline import Deadline
from trainfsm.preemption.policy import Preemption
from trainfsm.step import retries_used_up
from trainfsm.trail import files
from trainfsm.trail.files import last_event
from trainfsm.trail.schema import FORMAT_VERSION, new_run_id
from trainfsm.trail.writer import FLUSH_SECONDS, EventLog
from trainfsm.watchdog import Watchdog

if TYPE_CHECKING:
    from transitions import Machine

    from trainfsm.collectives import LossNoneAgreement
    from trainfsm.ddp_buckets import BucketOrder
    from trainfsm.oom import MemoryFit
    from trainfsm.step import Stepper
    from trainfsm.step_info import StepInfo
    from trainfsm.trainer import BaseTrainer


#: Every method of the hook contract a hook may define: ``BaseHook``'s and the state methods.
HOOK_METHODS: tuple[str, ...] = (
    *(name for name in vars(BaseHook) if name.startswith(("on_", "wants_")) and callable(vars(BaseHook)[name])),
    *(name for name, _, _ in fsm.state_hook_names()),
)


class Hooks:
    """Every call of a hook method (see the module's docstring for when each happens)."""

    def __init__(self, trainer: BaseTrainer, hooks: list[BaseHook]) -> None:
        self.trainer = trainer
        self.hooks = tuple(hooks)

        def overriding(name: str) -> tuple[BaseHook, ...]:  # BaseHook's no-ops are never called
            return tuple(hook for hook in hooks if overrides(hook, name))

        self._before_train = overriding("on_before_train")
        self._before_step = overriding("on_before_step")
        self._before_optimizer_step = overriding("on_before_optimizer_step")
        self._evaluate = overriding("on_evaluate")
        self._step_info = overriding("on_step_info")
        self._wants_stop = overriding("wants_stop")
        self._wants_checkpoint = overriding("wants_checkpoint")
        self._after_step = overriding("on_after_step")
        self._after_train = overriding("on_after_train")
        self._state_dict = overriding("on_state_dict")
        self._load_state_dict = overriding("on_load_state_dict")
        # BaseHook.on_log calls on_log_scalars (the other published spelling): either counts.
        self._log = tuple(hook for hook in hooks if overrides(hook, "on_log") or overrides(hook, "on_log_scalars"))
        self._log_images = overriding("on_log_images")
        for hook in hooks:  # a stalled rank's stack names the hook method it is in (trainfsm.activity)
            for name in HOOK_METHODS:
                if overrides(hook, name):
                    activity.name_hook(getattr(type(hook), name))
        #: The clocks of the hooks that write after CHECKPOINT (``BaseHook.background_writes``).
        self.background_writes = tuple(hook.background_writes for hook in hooks if hook.background_writes is not None)
        #: Whether a step's end has anything to ask or evaluate (most runs: only wants_checkpoint).
        self.at_step_end = bool(self._evaluate or self._step_info or self._wants_stop)

    def before_train(self) -> None:
        trainer = self.trainer
        for hook in self._before_train:
            hook.on_before_train(trainer)

    def before_step(self) -> None:
        trainer = self.trainer
        for hook in self._before_step:
            hook.on_before_step(trainer)

    def before_optimizer_step(self) -> None:
        trainer = self.trainer
        for hook in self._before_optimizer_step:
            hook.on_before_optimizer_step(trainer)

    def evaluate(self, progress: fsm.Progress) -> None:
        """The hooks' ``on_evaluate``, marked on ``progress`` while they run: the stall watchdog
        gives evaluations a budget of their own (a run without one pays nothing for it)."""
        if not self._evaluate:
            return
        trainer = self.trainer
        progress.evaluating = True
        try:
            for hook in self._evaluate:
                hook.on_evaluate(trainer)
        finally:
            progress.evaluating = False

    def step_info(self, info: StepInfo) -> None:
        trainer = self.trainer
        for hook in self._step_info:
            hook.on_step_info(trainer, info)

    def stop_wanted(self) -> bool:
        """Whether a hook ends the run; the first yes decides (later hooks are not asked)."""
        trainer = self.trainer
        return any(hook.wants_stop(trainer) for hook in self._wants_stop)

    def checkpoint_wanted(self) -> bool:
        """Whether a hook wants this step checkpointed; the first yes decides."""
        trainer = self.trainer
        return any(hook.wants_checkpoint(trainer) for hook in self._wants_checkpoint)

    def after_step(self) -> None:
        trainer = self.trainer
        for hook in self._after_step:
            hook.on_after_step(trainer)

    def after_train(self, failed: Callable[[Exception], None]) -> None:
        """EXIT always completes: a hook's failure goes to ``failed`` and the next hook runs."""
        trainer = self.trainer
        for hook in self._after_train:
            try:
                hook.on_after_train(trainer)
            except Exception as exc:
                failed(exc)

    def state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        for hook in self._state_dict:
            hook.on_state_dict(trainer, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        for hook in self._load_state_dict:
            hook.on_load_state_dict(trainer, state)

    def log(self, records: dict[str, Any], dry_run: bool) -> None:
        trainer = self.trainer
        for hook in self._log:
            hook.on_log(trainer, records, dry_run)

    def log_images(self, records: dict[str, Any], dry_run: bool) -> None:
        trainer = self.trainer
        for hook in self._log_images:
            hook.on_log_images(trainer, records, dry_run)

    def bind_states(
        self, machine: Machine, guarded: Callable[[Callable[[], Any]], None], last: Callable[[], None]
    ) -> None:
        """Bind each hook's ``on_enter_<state>`` / ``on_exit_<state>`` to the machine, in hook
        order; EXIT's guarded (recorded, raised at the end) and before ``last``, EXIT's own work."""
        trainer = self.trainer
        for hook in self.hooks:
            for name, kind, state in fsm.state_hook_names():
                method = getattr(hook, name, None)
                if method is None:
                    continue
                callback = partial(method, trainer)
                if state == fsm.EXIT:
                    fsm.bind(machine, kind, state, partial(guarded, callback), before=last)
                else:
                    fsm.bind(machine, kind, state, callback)


@dataclass(slots=True, eq=False)
class Run:
    machine: Machine
    event_log: EventLog  # the trail's writer; its logger is trainer.events
    preemption: Preemption
    logs: Path | None  # the workspace's logs directory (the trail), None without a workspace
    hooks: Hooks  # the built hooks' dispatcher (none before BUILD builds them)
    # Set in BUILD.
    stepper: Stepper | None = None
    agreement: LossNoneAgreement | None = None  # loss_none_agreement with several ranks
    warn_loss_none: bool = False  # the model is a DDP/FSDP wrapper
    triggers: dict[str, Callable[[], bool]] = field(default_factory=dict)  # name -> the compiled trigger
    watchdog: Watchdog | None = None  # the stall watchdog (stall_timeout), stopped just before the exit event
    buckets: dict[str, BucketOrder] = field(default_factory=dict)  # each DDP's gradient order (trainfsm.ddp_buckets)
    fit: MemoryFit | None = None  # max_oom_retries > 0: the split in force, the step's kept micro-batches
    # The step in flight (reset as it begins; a retry resets micro, losses and records).
    micro: int = 0
    retries: int = 0
    losses: list[torch.Tensor] = field(default_factory=list)
    records: list[Any] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    step_start: float = 0.0
    # EXIT: failures of EXIT's own work (raised once it is done), and the exception leaving train().
    exit_errors: list[BaseException] = field(default_factory=list)
    failure: BaseException | None = None

    def new_step(self) -> None:
        """A step begins: fresh lists (a hook may keep the previous step's until its interval ends)."""
        self.micro = self.retries = 0
        self.losses, self.records, self.data_times = [], [], []
        if self.fit is not None:
            self.fit.new_step()
        self.step_start = time.perf_counter()

    def non_finite_retry(self, step: int, limit: int, log: Any) -> None:
        """RETRY after non-finite gradients: counted, or the run fails past ``limit``; the step
        runs again on fresh micro-batches (none kept for it)."""
        if self.fit is not None:
            self.fit.new_step()
        if self.retries >= limit:
            raise retries_used_up(step, self.retries, limit)
        self.retries += 1
        log.warning("non_finite", what="gradients", retry=self.retries, max=limit, scale=None)

    def close(self, preempted: bool) -> None:
        """``train()`` is leaving: the watchdog stopped (at EXIT already, unless EXIT was never
        reached), a preempted run's wait, the signal report, the trail closed last."""
        if self.watchdog is not None:
            self.watchdog.stop()
        try:
            if preempted:
                # With the trail open: a signal that cuts exit_wait short (SLURM's kill) is
                # recorded after ``exit``, as is one that came during EXIT's last lines.
                self.preemption.wait_before_exit()
            with contextlib.suppress(Exception):  # a record at most: never the run's outcome
                self.preemption.report()
        finally:
            self.event_log.close()

    def step_figures(self, info: StepInfo) -> None:
        """The applied step's figures in trainloop's layout: per micro-batch lists (detached losses,
        records, data times; no averaging here, so no kernel and no sync), the step's time and its
        retry count."""
        info["loss"] = self.losses
        info["records"] = self.records
        info["data_time"] = self.data_times
        info["step_time"] = time.perf_counter() - self.step_start
        info["non_finite_grad_retry_count"] = info["non_finite_grad_retries"] = self.retries

    def bind_hooks(self, trainer: BaseTrainer, hooks: list[BaseHook], finish_exit: Callable[[], None]) -> None:
        """The built hooks' dispatcher, their state methods bound, the machine compiled again, and
        the triggers by name (the step's end picks one by name: ``fsm.step_end_trigger``)."""
        self.hooks = Hooks(trainer, hooks)
        self.hooks.bind_states(self.machine, self.guarded, finish_exit)
        self.machine.compile_events(trainer, self.event_log.transition_recorder)
        self.triggers = {name: getattr(trainer, name) for name in fsm.TRIGGERS}

    def guarded(self, callback: Callable[[], Any]) -> None:
        """Run an EXIT callback; a failure is recorded and raised after EXIT's work is done."""
        try:
            callback()
        except Exception as exc:
            self.failed(exc)

    def failed(self, exc: Exception) -> None:
        """A failure of EXIT's work: recorded now, raised once EXIT is done."""
        self.event_log.exception(exc)
        self.exit_errors.append(exc)

    def record_failure(self, trainer: BaseTrainer, exc: BaseException) -> None:
        """``exc`` is leaving ``train()``: record it, and take the machine to EXIT by ``fail``
        (unless it came from EXIT itself), with the exit status the process will end with."""
        if isinstance(exc, torch.OutOfMemoryError) and not trainer.max_oom_retries:
            hint = "trainfsm: BaseTrainer(max_oom_retries=N) would run the step again in smaller micro-batches"
            exc.add_note(hint)  # type: ignore[attr-defined]
        stalled = self.watchdog.stalled_for() if self.watchdog is not None else None  # the note names the stall
        failed = failed_collective(
            exc, trainer.rank, trainer.world_size, trainer.step, trainer.state, self.logs, stalled
        )
        if failed is not None:  # most likely another rank's failure: the note says where to look
            trainer.events.error("collective_failed", **failed)
            stopped_by = self.preemption.stopped_for_restart()
            if stopped_by is not None:
                trainer.events.warning("restart_stop", signal=stopped_by)
        self.event_log.exception(exc)
        if trainer.state == fsm.EXIT:
            return
        trainer.exit_reason, trainer.exit_code = exit_status(exc)
        self.failure = exc
        try:
            trainer.fail()
        except BaseException as inner:  # EXIT's own work failed: record it, keep the original error
            self.event_log.exception(inner)


def open_trail(trainer: BaseTrainer, preemption: Preemption) -> tuple[EventLog, Path | None]:
    """The trail of this attempt, with its ``run_start`` record. Sets the trainer's ``rank``,
    ``world_size``, ``run_id``, ``attempt`` and ``slurm`` (a later attempt keeps the run id)."""
    rank, world = collectives.rank_and_world()
    logs = trainer.workspace / files.LOGS if trainer.workspace else None
    path = logs / files.active_name(rank) if logs else None
    previous = last_event(path) if path else None  # the previous attempt's end
    run_id, attempt = (str(previous["run_id"]), int(previous["attempt"]) + 1) if previous else (new_run_id(), 0)
    trainer.run_id, trainer.attempt = collectives.share_run_id(run_id, attempt)
    trainer.rank, trainer.world_size = rank, world
    events = EventLog(
        path=path,
        console=trainer.logger,
        rank=rank,
        run_id=trainer.run_id,
        attempt=trainer.attempt,
        progress=lambda: (trainer.step, trainer.state),
        owner=trainer,
        form=trainer.trail_form,
    )
    events.previous_end = previous
    trainer.events = events.log
    job = slurm.detect()
    if job is not None and rank == 0:  # the job's end and partition: scontrol calls per job, not per rank
        job = slurm.with_job_details(job)
    trainer.slurm = job
    preemption.open_trail(events.log, rank, world, trainer.slurm)
    events.log.info(
        "run_start",
        format=FORMAT_VERSION,
        world_size=world,
        max_steps=trainer.max_steps,
        slurm=trainer.slurm.as_event() if trainer.slurm else None,
        signals=preemption.at_start,
        torchelastic=torchelastic.launch(),
        trail={"form": trainer.trail_form, "flush_seconds": FLUSH_SECONDS, "segment_bytes": events.segment_bytes},
        versions={"trainfsm": _version(), "torch": torch.__version__, "python": platform.python_version()},
        config={
            "grad_clip": trainer.grad_clip,
            "max_non_finite_grad_retries": trainer.max_non_finite_grad_retries,
            "max_oom_retries": trainer.max_oom_retries,
            "mixed_precision": trainer.mixed_precision,
            "device": str(trainer.device),
            "gradient_accumulation_steps": trainer.gradient_accumulation_steps,
            "workspace": str(trainer.workspace) if trainer.workspace else None,
            "max_epochs": trainer.max_epochs,
            "loss_none_agreement": trainer.loss_none_agreement,
        },
    )
    return events, logs


def exit_status(exc: BaseException) -> tuple[ExitReason, int]:
    """The exit reason, and the status the process ends with once ``exc`` leaves ``train()``
    uncaught: the trail's exit code is the one the shell sees.

    Python re-raises an uncaught KeyboardInterrupt by killing itself with SIGINT (the shell sees
    128 + 2); it exits with a SystemExit's code (None: 0; an int, modulo 256 as the OS keeps it;
    anything else is printed and gives 1); any other exception gives 1."""
    if isinstance(exc, KeyboardInterrupt):
        return ExitReason.INTERRUPTED, 128 + signal.SIGINT
    if isinstance(exc, SystemExit):
        code = exc.code
        status = 0 if code is None else int(code) & 0xFF if isinstance(code, int) else 1
        return (ExitReason.FAILED if status else ExitReason.STOPPED), status
    return ExitReason.FAILED, 1


def _version() -> str:
    from trainfsm import __version__

    return __version__


def start_watchdog(trainer: BaseTrainer, progress: fsm.Progress, run: Run) -> Watchdog | None:
    """The watchdog thread of this ``train()``, started: stalls, and the job's end (rank 0 under
    SLURM with a time limit); None when neither is watched."""
    job_end = run.preemption.follow_job_end(for_deadline=trainer.job_end_margin is not None)
    deadline = Deadline.for_job(job_end, trainer.job_end_margin, trainer.world_size)
    if trainer.stall_timeout is None and deadline is None:
        return None
    watchdog = Watchdog(
        timeout=trainer.stall_timeout,
        action=trainer.stall_action,
        progress=progress,
        trainer=trainer,
        event_log=run.event_log,
        micro=lambda: run.micro,
        requeue=run.preemption.requeue_after_stall,
        deadline=deadline,
        on_deadline=run.preemption.deadline_reached,
        writes=lambda: run.hooks.background_writes,
    )
    watchdog.start()
    return watchdog
