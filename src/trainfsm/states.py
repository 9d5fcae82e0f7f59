"""What each state does: one function per state, called by ``BaseTrainer.train()``'s loop.

Each takes the trainer and its ``Run``, does its state's work and returns the trigger that leaves
the state (``train()`` fires it, and calls the function of the state it leads to, until EXIT).
Two are state entries the trainer binds on the machine instead: ``begin_step`` (STEP) and
``finish_exit`` (EXIT, after the hooks' ``on_enter_exit``). Hooks are called through the
dispatcher (``trainfsm.run.Hooks``); the audit events of the transitions are the machine's.
They live here, not on ``BaseTrainer``, so that the class a user reads is the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from time import perf_counter
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainfsm import data_order, ddp_buckets
from trainfsm import machine as fsm
from trainfsm import options as check
from trainfsm.collectives import LossNoneAgreement, loss_none_ranks
from trainfsm.data_cursor import EXHAUSTED
from trainfsm.hooks.base import BaseHook
from trainfsm.machine import ExitReason
from trainfsm.oom import MemoryFit, oom_shared
from trainfsm.step import Stepper
from trainfsm.step_info import StepInfo
from trainfsm.torch_workarounds import release_groups_at_exit, warn_if_group_kept_alive
from trainfsm.utils import is_distributed_wrapper

if TYPE_CHECKING:
    from trainfsm.run import Run
    from trainfsm.trainer import BaseTrainer


def build(trainer: BaseTrainer, run: Run, finish_exit: Callable[[], None]) -> Callable[[], bool]:
    if trainer.world_size > 1 and trainer.loss_none_agreement:  # first: it may create a gloo group
        run.agreement = LossNoneAgreement(rank=trainer.rank, world=trainer.world_size, watcher=run.preemption.watcher)
    trainer.data_loader = check.built("build_data_loader", trainer.build_data_loader(), Iterable)
    trainer.model = check.built("build_model", trainer.build_model(), nn.Module)
    trainer.optimizer = check.built("build_optimizer", trainer.build_optimizer(), torch.optim.Optimizer)
    warn_if_group_kept_alive(trainer.events)  # checked here: building the first optimizer may import it
    release_groups_at_exit()  # a group the script destroys while it keeps the model: gone before shutdown
    trainer.lr_scheduler = trainer.build_lr_scheduler()
    trainer.grad_scaler = check.built("build_grad_scaler", trainer.build_grad_scaler(), torch.amp.GradScaler)
    trainer.hooks = list(check.built("build_hooks", trainer.build_hooks(), (list, tuple)))
    for hook in trainer.hooks:
        check.built("build_hooks", hook, BaseHook)
    trainer.gradient_accumulation_steps, layout = data_order.settle(
        trainer.data_loader, trainer.rank, trainer.world_size, trainer.gradient_accumulation_steps,
        trainer._accumulation_given, trainer.global_batch_size,
    )  # fmt: skip
    trainer._data.attach(trainer.data_loader, trainer.max_epochs, trainer.events, layout)
    run.warn_loss_none = is_distributed_wrapper(trainer.model)
    run.buckets = ddp_buckets.watch(trainer.model, trainer.world_size, trainer.events)
    run.stepper = Stepper.for_trainer(trainer, run.agreement)
    if trainer.max_oom_retries:
        run.fit = MemoryFit(
            trainer.max_oom_retries, trainer.gradient_accumulation_steps, oom_shared(trainer, run.agreement)
        )
    trainer.exit_policy = run.preemption.decide(trainer.hooks, run.agreement)
    run.bind_hooks(trainer, trainer.hooks, finish_exit)
    return preempted_before_training(trainer, run) or trainer.built


def restore(trainer: BaseTrainer, run: Run) -> Callable[[], bool]:
    # Hooks (the checkpoint hook) restored state in on_enter_restore.
    # How this rank's micro-batches map onto each epoch's order (the data ledger's key): DEBUG,
    # for the file, which the INFO ``restore`` after it writes at once.
    trainer.events.debug("data_layout", **trainer._data.layout.as_event())  # type: ignore[union-attr]
    trainer.events.info("restore", resumed=trainer.step > 0, from_step=trainer.step)
    if trainer.step >= trainer.max_steps:  # resumed from a finished run: nothing left to do
        trainer.exit_reason, trainer.exit_code = ExitReason.COMPLETED, 0
        run.hooks.before_train()
        return trainer.finish  # a signal now is recorded in EXIT: the run is complete, no requeue
    resumed = trainer._data.start()
    if resumed is not None:  # how the position was found and what it cost: a replay grows with it
        trainer.events.info("data_resumed", epoch=trainer.epoch, from_step=trainer.step, **resumed.as_event())
        trainer._data.fingerprint_next("resume", trainer.step)  # the data ledger's check of the position
    # Checked last: a signal while the checkpoint loaded or the data was positioned counts.
    preempted = preempted_before_training(trainer, run)
    if preempted is not None:
        return preempted
    run.hooks.before_train()
    return trainer.restored


def begin_step(trainer: BaseTrainer, run: Run) -> None:
    trainer.step += 1
    trainer.step_info = StepInfo()
    run.new_step()
    run.preemption.step_began()
    run.hooks.before_step()


def accumulate(trainer: BaseTrainer, run: Run) -> Callable[[], bool]:
    """One micro-batch. With ``max_oom_retries`` (``run.fit``) the step's micro-batches are kept
    (a retry runs them again) and split as the run's out-of-memory errors made them; such an
    error leaves by ``oom`` for RETRY once its ``except`` has dropped the failed graph."""
    fit = run.fit
    t0 = perf_counter()
    batch = trainer._data.next() if fit is None else fit.next(trainer._data.next)
    if batch is EXHAUSTED:
        return data_ran_out(trainer, run)
    run.data_times.append(perf_counter() - t0)
    last = run.micro + 1 == trainer.gradient_accumulation_steps
    if fit is None or fit.failure is None:
        try:
            if fit is None:
                loss, records = run.stepper.micro(trainer.forward, batch, last)  # type: ignore[union-attr]
            else:
                loss, records = fit.micro(run.stepper, trainer.forward, batch, last)  # type: ignore[arg-type]
        except torch.OutOfMemoryError as exc:
            if fit is None:
                raise
            fit.caught(exc, run.micro, batch)
        else:  # not under the ``try``: the step's end (optimizer step) is never retried
            if loss is None:  # on this rank; with loss_none_agreement, on any: then every rank skips it
                trainer.loss_none_skips += 1  # this rank skipped it, whichever rank returned None
                ranks = loss_none_ranks(run.agreement, trainer.rank, run.warn_loss_none)
                trainer.events.debug("loss_none", micro=run.micro, ranks=ranks)
                return trainer.micro
            run.micro += 1
            run.losses.append(loss)
            run.records.append(records)
            return end_step(trainer, run) if last else trainer.micro
        if not fit.shared:
            return trainer.oom
    # Out of memory in this step, with DDP over several ranks: on to the step's end with the others.
    fit.shadow(run.stepper, trainer.forward, batch, run.micro, last)  # type: ignore[arg-type]
    run.micro += 1
    return end_step(trainer, run) if last else trainer.micro


def end_step(trainer: BaseTrainer, run: Run) -> Callable[[], bool]:
    """The step's last micro-batch ran: check, step the optimizer, fill ``step_info``, decide."""
    stepper: Stepper = run.stepper  # type: ignore[assignment]
    finite, grad_norm = stepper.check_and_clip()
    if not finite:
        if run.fit is not None and run.fit.ran_out(trainer.rank, trainer.world_size, trainer.grad_scaler):
            return trainer.oom
        if not stepper.scaler_enabled:
            return trainer.non_finite
        scale = trainer.grad_scaler.get_scale() if trainer.grad_scaler else None
        trainer.events.warning("non_finite", what="scaler_skip", retry=0, max=0, scale=scale)
    info = trainer.step_info
    if grad_norm is not None:
        info["grad_norm"] = grad_norm
    hooks = run.hooks
    hooks.before_optimizer_step()
    stepper.apply(finite)
    run.step_figures(info)
    # The decision point: evaluations first, then the questions; a signal that arrives during
    # them is read after and honoured at this step (with one rank).
    stop = False
    if hooks.at_step_end:
        hooks.evaluate(run.machine.progress)
        hooks.step_info(info)  # before any on_after_step reads the step's figures
        stop = hooks.stop_wanted()
    code = run.preemption.at_step_end(trainer.step)
    reason = fsm.step_end_reason(preempted=code is not None, stop=stop, last=trainer.step >= trainer.max_steps)
    if reason is not None:
        trainer.exit_reason, trainer.exit_code = reason, code if code is not None else 0
    # Asked once the exit reason is known: CheckpointingHook saves the last step of any run.
    trigger = run.triggers[fsm.step_end_trigger(reason, save=hooks.checkpoint_wanted())]
    hooks.after_step()
    return trigger


def preempted_before_training(trainer: BaseTrainer, run: Run) -> Callable[[], bool] | None:
    """A signal during BUILD or RESTORE: nothing worth saving exists yet; leave by ``preempt``."""
    code = run.preemption.before_training()
    if code is None:
        return None
    trainer.exit_reason, trainer.exit_code = ExitReason.PREEMPTED, code
    return trainer.preempt


def data_ran_out(trainer: BaseTrainer, run: Run) -> Callable[[], bool]:
    """``max_epochs`` epochs are done: the step that began has no data, so it never happens.

    Gradients of any micro-batches it already ran are dropped (like ``drop_last``), and
    ``trainer.step`` goes back to the last completed step, which CHECKPOINT then saves.
    """
    run.stepper.discard()  # type: ignore[union-attr]
    run.preemption.end_step_agreement()
    trainer.exit_reason, trainer.exit_code = ExitReason.COMPLETED, 0
    trainer.events.info("data_exhausted", epochs=trainer.max_epochs, dropped_micro_batches=run.micro)
    trainer.step -= 1  # after the event, which belongs to the step that began; see fsm.STEP_TAKEN_BACK
    return trainer.exhausted


def retry(trainer: BaseTrainer, run: Run) -> Callable[[], bool]:
    run.stepper.discard()  # type: ignore[union-attr]
    if run.fit is not None and run.fit.failure is not None:  # out of memory: the same micro-batches, smaller
        run.fit.retry(trainer.step, trainer.events, trainer.device)
    else:  # non-finite: fresh micro-batches
        run.non_finite_retry(trainer.step, trainer.max_non_finite_grad_retries, trainer.events)
    run.micro = 0
    run.losses, run.records = [], []  # the retried micro-batches' data times stay: spent in this step
    return trainer.retry


def checkpoint(trainer: BaseTrainer, run: Run) -> Callable[[], bool]:
    # The checkpoint hook saved in on_enter_checkpoint; leave for good or for the next step.
    trigger = fsm.checkpoint_trigger(trainer.exit_reason)
    if trigger == "resume":  # the batch after a save: a resume from it must draw the same one
        trainer._data.fingerprint_after_save(trainer.step)
    else:  # leaving after a save: the batch a resume must draw first, drawn now and dropped
        trainer._data.fingerprint_at_exit(trainer.step)
    return run.triggers[trigger]


def finish_exit(trainer: BaseTrainer, run: Run) -> None:
    run.guarded(trainer._data.close)
    # A failure in EXIT's own work is raised at the end (status 1), unless an exception is
    # already on its way out of train(): that one decides the status, and run.record_failure
    # recorded it.
    if trainer.exit_reason is None or (run.exit_errors and run.failure is None):
        trainer.exit_reason, trainer.exit_code = ExitReason.FAILED, 1
    run.preemption.at_exit(trainer.exit_reason is ExitReason.PREEMPTED)
    if run.watchdog is not None:  # the exit event is the attempt's last: no stall event after it
        run.watchdog.stop()
    trainer.events.info("exit", reason=trainer.exit_reason, code=trainer.exit_code)
