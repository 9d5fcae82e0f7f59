"""``BaseHook``: the methods a hook may override; every one is a no-op here.

The trainer's dispatcher (``trainfsm.run.Hooks``) calls only the methods a hook overrides, so a
hook costs nothing where it does nothing; its docstring says when each is called. Besides the
methods below, a hook may define ``on_enter_<state>(trainer)`` / ``on_exit_<state>(trainer)`` for
any state (``on_enter_checkpoint``, ``on_exit_restore``, ...), bound to the machine's states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainfsm.checkpoint.background import WriteTimes
    from trainfsm.preemption.policy import ExitPolicy
    from trainfsm.step_info import StepInfo
    from trainfsm.trainer import BaseTrainer


class BaseHook:
    """Lifecycle hooks for ``BaseTrainer``; override the methods you need."""

    #: Signals on which the run should end cleanly (checkpoint, requeue, exit 128+signal), declared
    #: by a hook: the first hook whose policy names signals decides, unless the trainer's
    #: ``set_exit_signals()`` did. ``CheckpointingHook`` sets it from its ``exit_*`` arguments;
    #: build one with ``trainfsm.preemption.policy.exit_policy``. None: this hook has no say.
    exit_policy: ExitPolicy | None = None
    #: The clock of a hook that writes checkpoints on a thread of its own, after CHECKPOINT
    #: (``CheckpointingHook(async_save=True)``): the job's end plans for what it still has to write
    #: (``trainfsm.preemption.deadline``). None: this hook's saves are done when CHECKPOINT is.
    background_writes: WriteTimes | None = None

    def on_before_train(self, trainer: BaseTrainer) -> None:
        """Once, after RESTORE: the trainer is built and resumed, before the first step."""

    def on_after_train(self, trainer: BaseTrainer) -> None:
        """Once, entering EXIT, whatever the exit reason (``trainer.exit_reason``)."""

    def on_before_step(self, trainer: BaseTrainer) -> None:
        """Entering STEP; ``trainer.step`` is the step about to run (1-based)."""

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        """After unscale and clip, right before ``optimizer.step()``."""

    def on_step_info(self, trainer: BaseTrainer, info: StepInfo) -> None:
        """Add this hook's figures of the step to ``info`` (``trainer.step_info``), such as
        ``CudaMaxMemoryHook``'s ``max_memory``. Every hook's ``on_step_info`` runs after the
        step's evaluations and before any hook's ``on_after_step``, so the hooks that read the
        figures need not be listed after the ones that write them."""

    def on_after_step(self, trainer: BaseTrainer) -> None:
        """After the optimizer step; ``trainer.step_info`` holds the step's figures."""

    def on_log(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        """``trainer.log(records)`` was called. By default this calls ``on_log_scalars``, the other
        published spelling, so a hook written for either runs unchanged."""
        self.on_log_scalars(trainer, records, dry_run)

    def on_log_scalars(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        """Alias of ``on_log`` (override one of the two)."""

    def on_log_images(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        """``trainer.log_images(records)`` was called."""

    def on_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        """Add this hook's resumable state to ``state_dict`` (a checkpoint is being made)."""

    def on_load_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        """Restore this hook's state from ``state_dict`` (a checkpoint is being loaded)."""

    def on_evaluate(self, trainer: BaseTrainer) -> None:
        """After each optimizer step, before the trainer decides how to go on: the place to
        evaluate, so a result can still change this step's decision (``wants_stop`` and
        ``wants_checkpoint`` are asked after every hook's ``on_evaluate``)."""

    def wants_checkpoint(self, trainer: BaseTrainer) -> bool:
        """Asked after each optimizer step: should the machine go through CHECKPOINT now?"""
        return False

    def wants_stop(self, trainer: BaseTrainer) -> bool:
        """Asked after each optimizer step: should training stop (exit reason ``stopped``)?"""
        return False


def overrides(hook: BaseHook, name: str) -> bool:
    """Whether ``hook`` defines ``name`` itself rather than inheriting BaseHook's no-op."""
    method = getattr(type(hook), name, None)
    return method is not None and method is not getattr(BaseHook, name, None)
