"""One call of ``train()``: the state its machine's states share, and the trail's first record.

``BaseTrainer`` keeps what the user configured and what users' code reads (``step``,
``step_info``, ``exit_reason``, the built components); everything that exists only while
``train()`` runs lives in one ``Run``, created by ``train()``, so no attribute appears on the
trainer after ``__init__``.
"""

from __future__ import annotations

import platform
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainfsm import collectives
from trainfsm import machine as fsm
from trainfsm.collectives import failed_collective
from trainfsm.hooks.base import BaseHook, bindings, overrides
from trainfsm.machine import ExitReason
from trainfsm.preemption import slurm, torchelastic
from trainfsm.preemption.policy import Preemption
from trainfsm.trail import files
from trainfsm.trail.files import previous_attempt
from trainfsm.trail.schema import FORMAT_VERSION, new_run_id
from trainfsm.trail.writer import FLUSH_SECONDS, EventLog

if TYPE_CHECKING:
    from transitions import Machine

    from trainfsm.collectives import LossNoneAgreement
    from trainfsm.step import Stepper
    from trainfsm.step_info import StepInfo
    from trainfsm.trainer import BaseTrainer


@dataclass(slots=True, eq=False)
class Run:
    machine: Machine
    event_log: EventLog  # the trail's writer; its logger is trainer.events
    preemption: Preemption
    logs: Path | None  # the workspace's logs directory (the trail), None without a workspace
    # Set in BUILD.
    stepper: Stepper | None = None
    agreement: LossNoneAgreement | None = None  # loss_none_agreement with several ranks
    warn_loss_none: bool = False  # the model is a DDP/FSDP wrapper
    before_optimizer_step: list[Callable[[], None]] = field(default_factory=list)
    evaluators: list[Callable[[], None]] = field(default_factory=list)
    step_info_writers: list[Callable[[StepInfo], None]] = field(default_factory=list)
    checkpoint_askers: list[Callable[[], bool]] = field(default_factory=list)
    stop_askers: list[Callable[[], bool]] = field(default_factory=list)
    step_end_hooks: bool = False  # any of the three lists above is not empty
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
        self.step_start = time.perf_counter()

    def bind_hooks(self, trainer: BaseTrainer, hooks: list[BaseHook], finish_exit: Callable[[], None]) -> None:
        """Bind each hook's overridden methods, in list order, after the trainer's own bookkeeping
        (bound before BUILD); collect the ones the trainer calls itself at a step's end."""
        m = self.machine
        self.before_optimizer_step = [
            partial(h.on_before_optimizer_step, trainer) for h in hooks if overrides(h, "on_before_optimizer_step")
        ]
        self.evaluators = [partial(h.on_evaluate, trainer) for h in hooks if overrides(h, "on_evaluate")]
        self.step_info_writers = [partial(h.on_step_info, trainer) for h in hooks if overrides(h, "on_step_info")]
        self.checkpoint_askers = [
            partial(h.wants_checkpoint, trainer) for h in hooks if overrides(h, "wants_checkpoint")
        ]
        self.stop_askers = [partial(h.wants_stop, trainer) for h in hooks if overrides(h, "wants_stop")]
        self.step_end_hooks = bool(self.evaluators or self.step_info_writers or self.stop_askers)
        for hook in hooks:
            for kind, target, method in bindings(hook):
                callback = partial(method, trainer)
                if target == fsm.EXIT:  # EXIT always completes: hook failures are recorded, then raised
                    fsm.bind(m, kind, target, partial(self.guarded, callback), before=finish_exit)
                else:
                    fsm.bind(m, kind, target, callback)
        m.compile_events(trainer, self.event_log.transition_recorder)

    def guarded(self, callback: Callable[[], Any]) -> None:
        """Run an EXIT callback; a failure is recorded and raised after EXIT's work is done."""
        try:
            callback()
        except Exception as exc:
            self.event_log.exception(exc)
            self.exit_errors.append(exc)

    def record_failure(self, trainer: BaseTrainer, exc: BaseException) -> None:
        """``exc`` is leaving ``train()``: record it, and take the machine to EXIT by ``fail``
        (unless it came from EXIT itself), with the exit status the process will end with."""
        failed = failed_collective(exc, trainer.rank, trainer.world_size, trainer.step, trainer.state, self.logs)
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
    previous = previous_attempt(path) if path else None
    run_id, attempt = (previous[0], previous[1] + 1) if previous else (new_run_id(), 0)
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
    trainer.events = events.log
    trainer.slurm = slurm.detect()
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
