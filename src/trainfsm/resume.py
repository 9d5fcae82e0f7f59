"""What ``trainer.state_dict()`` holds and how ``load_state_dict()`` puts it back.

The trainer owns its resumable state; this module is the order in which its parts are captured
and restored, which is where exact resume is won or lost: the random streams are captured last
(after every hook ran), and on load the scheduler goes before the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainfsm import ddp_buckets, rng
from trainfsm.torch_workarounds import capture_model_and_optimizer, load_model_and_optimizer

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainfsm.data_cursor import DataCursor
    from trainfsm.run import Hooks
    from trainfsm.trainer import BaseTrainer


def built(trainer: BaseTrainer, method: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer ``method`` needs, or an error that says when they exist."""
    if trainer.model is None or trainer.optimizer is None:
        raise RuntimeError(
            f"{method}() needs the built model and optimizer; they exist once train() has run BUILD "
            f"(call it from a hook, or after train())."
        )
    return trainer.model, trainer.optimizer


def capture(trainer: BaseTrainer, options: Any, data: DataCursor, hooks: Hooks) -> dict[str, Any]:
    model, optimizer = built(trainer, "state_dict")
    options = options if options is not None else trainer.state_dict_options
    # torch's get_state_dict, without the zero-gradient optimizer step it takes for an optimizer
    # without state (SGD without momentum) at every save: see trainfsm.torch_workarounds.
    model_state, optim_state = capture_model_and_optimizer(model, optimizer, options)
    scheduler, scaler = trainer.lr_scheduler, trainer.grad_scaler
    state: dict[str, Any] = {
        "model": model_state,
        "optimizer": optim_state,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
        "step": trainer.step,
        "epoch": trainer.epoch,
    }
    run = trainer._run
    if run is not None and run.buckets:  # rank 0's is the one kept: DDP broadcasts rank 0's layout
        state["ddp_buckets"] = {name: order.state() for name, order in run.buckets.items()}
    hooks.state_dict(state)
    # Last: the random streams as they stand once everything above ran.
    state["rank_state"] = {"rng": rng.capture(), "data": data.state(), "loss_none_skips": trainer.loss_none_skips}
    return state


def restore(
    trainer: BaseTrainer,
    options: Any,
    data: DataCursor,
    state: dict[str, Any],
    data_resume: str,
    hooks: Hooks,
) -> None:
    model, optimizer = built(trainer, "load_state_dict")
    options = options if options is not None else trainer.state_dict_options
    # The scheduler before the optimizer: a scheduler's load may write its view of the learning
    # rates into the param groups, and the optimizer's saved groups (lr, initial_lr) must be the
    # last word, or a resumed run trains at the wrong rate.
    scheduler, scaler = trainer.lr_scheduler, trainer.grad_scaler
    if scheduler is not None and state.get("lr_scheduler") is not None:
        scheduler.load_state_dict(state["lr_scheduler"])
    load_model_and_optimizer(model, optimizer, state["model"], state["optimizer"], options)
    if scaler is not None and state.get("grad_scaler"):
        scaler.load_state_dict(state["grad_scaler"])
    trainer.step = int(state["step"])
    trainer.epoch = int(state.get("epoch", 0))
    hooks.load_state_dict(state)
    mine = state.get("rank_state")
    if mine is not None and data_resume == "none":
        rng.restore(mine["rng"])
    elif mine is not None and mine.get("data") is not None:
        data.resume_later(data_resume, mine["data"], mine["rng"])
    elif mine is not None:  # another world size, and an old rank saved no position: a fresh pass
        rng.restore(mine["rng"])
    run = trainer._run
    if run is not None and run.buckets:  # RESTORE, every rank at once: DDP gets the saved layout
        ddp_buckets.prime_all(run.buckets, state.get("ddp_buckets"), trainer.step, trainer.events)
