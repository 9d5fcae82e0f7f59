"""``EarlyStoppingHook``: stop when a logged metric stops improving; keep a ``best`` checkpoint pointer.

It reads the monitored value from what ``trainer.log`` receives (``"val/loss"`` is
``records["val"]["loss"]``, or a flat ``records["val/loss"]``); each log call that carries it is
one evaluation. A value better than the best so far by more than ``min_delta`` is an improvement;
otherwise (NaN and infinities included) the count of evaluations without improvement grows, and when it reaches
``patience`` the hook asks the machine to stop (``wants_stop``): the trainer checkpoints, since
``CheckpointingHook`` saves whenever an exit reason is set, and EXITs with reason ``stopped``.

The ``best`` pointer: an improvement asks for a checkpoint (``wants_checkpoint``) and has
``CheckpointingHook.point_when_saved`` move ``best`` as part of that save, right after ``latest``
and before pruning (also for an asynchronous save), and pruning never deletes a pointer's target.
When the value is logged at the step's decision point, as ``ValidationHook`` does (every hook's
``on_evaluate`` runs before any ``wants_*`` is asked), that checkpoint holds exactly the evaluated
weights. A value logged later in a
step (from ``on_after_step``) is checkpointed at the end of the next step, the first chance left.

Resumable state, saved under ``early_stopping:<monitor>``: the best value, the step it was logged
at, the count of evaluations without improvement, and an improvement not yet checkpointed (so that
a run resumed from the checkpoint that made it points ``best`` there, if the pointer was lost).

The monitored value must be the same on every rank (``ValidationHook`` averages over ranks), or the
ranks disagree about stopping and checkpointing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from trainfsm.hooks.base import BaseHook
from trainfsm.hooks.checkpointing import CheckpointingHook

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

BEST: Final = "best"
MODES: Final = ("min", "max")


class EarlyStoppingHook(BaseHook):
    """Stop after ``patience`` evaluations of ``monitor`` without an improvement, and keep a ``best``
    checkpoint pointer (with a ``CheckpointingHook``).

    Arguments:

    - ``monitor`` (default ``"val/loss"``): the value to watch, as ``trainer.log`` receives it, nested
      keys joined by ``/`` (``ValidationHook``'s ``loss`` under ``val``); each log call that carries
      it is one evaluation. It must be the same on every rank.
    - ``mode`` (default ``"min"``): ``"min"``, lower is better; ``"max"``, higher is better.
    - ``patience`` (default 3): evaluations without an improvement before the run stops (exit
      reason ``stopped``, after a checkpoint).
    - ``min_delta`` (default 0.0): how much better than the best so far a value must be to count as
      an improvement (NaN and infinities never do).
    """

    def __init__(self, monitor: str = "val/loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if not isinstance(monitor, str) or not monitor or "" in monitor.split("/"):
            raise ValueError(
                f"EarlyStoppingHook monitor must name a logged value, nested keys joined by '/' (e.g. 'val/loss'); "
                f"got {monitor!r}."
            )
        if mode not in MODES:
            raise ValueError(f"EarlyStoppingHook mode must be one of {MODES}; got {mode!r}.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"EarlyStoppingHook patience must be an int >= 1 (evaluations without improvement before "
                f"stopping); got {patience!r}."
            )
        if (
            isinstance(min_delta, bool)
            or not isinstance(min_delta, (int, float))
            or not math.isfinite(min_delta)
            or min_delta < 0
        ):
            raise ValueError(f"EarlyStoppingHook min_delta must be a finite number >= 0; got {min_delta!r}.")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.key = f"early_stopping:{monitor}"
        self._path = tuple(monitor.split("/"))
        # mode="max" is mode="min" of the negated value: one comparison below.
        self._sign = 1.0 if mode == "min" else -1.0
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evaluations = 0
        self._unsaved: int | None = None  # step of an improvement whose checkpoint is not made yet
        self._checkpoints: CheckpointingHook | None = None  # the hook that keeps ``best``, found before training

    # ------------------------------------------------------------------ reading the metric
    def on_log(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        if dry_run:
            return
        value = _lookup(records, self._path, self.monitor)
        if value is None:
            return
        try:
            number = float(value)  # a tensor: one host read per evaluation
        except (TypeError, ValueError):
            raise TypeError(
                f"EarlyStoppingHook monitor {self.monitor!r} must be logged as a number or a one-element tensor; "
                f"got {value!r}."
            ) from None
        self.update(number, trainer.step)

    def update(self, value: float, step: int) -> bool:
        """Count one evaluation of ``value`` at ``step``; True if it improved on the best."""
        best = self.best
        if not math.isfinite(value) or (best is not None and self._sign * (best - value) <= self.min_delta):
            self.bad_evaluations += 1
            return False
        self.best, self.best_step, self.bad_evaluations = value, step, 0
        if self._checkpoints is not None:
            self._unsaved = step
            self._checkpoints.point_when_saved(BEST, step)
        return True

    # ------------------------------------------------------------------ the machine's questions
    def wants_checkpoint(self, trainer: BaseTrainer) -> bool:
        return self._unsaved is not None

    def wants_stop(self, trainer: BaseTrainer) -> bool:
        if self.bad_evaluations < self.patience:
            return False
        trainer.events.info(
            "early_stop",
            monitor=self.monitor,
            best=self.best,
            best_step=self.best_step,
            bad_evaluations=self.bad_evaluations,
            patience=self.patience,
        )
        return True

    def on_exit_checkpoint(self, trainer: BaseTrainer) -> None:
        self._unsaved = None  # this checkpoint's save moves (or moved) the pointer

    # ------------------------------------------------------------------ store and resume
    def on_before_train(self, trainer: BaseTrainer) -> None:
        hooks = trainer.hooks
        self._checkpoints = next((h for h in hooks if isinstance(h, CheckpointingHook)), None)
        if self._unsaved is None:
            return
        # Resumed from the checkpoint that was saved with an improvement pending: that checkpoint is
        # the one ``best`` names (again, in case the process died before the pointer moved).
        self._unsaved = None
        if self._checkpoints is not None:
            self._checkpoints.point_to_loaded(trainer, BEST)

    def on_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        state_dict[self.key] = {
            "best": self.best,
            "best_step": self.best_step,
            "bad_evaluations": self.bad_evaluations,
            "unsaved": self._unsaved,
        }

    def on_load_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get(self.key)
        if saved is None:  # a checkpoint from before this hook was added: start counting now
            return
        self.best, self.best_step = saved["best"], saved["best_step"]
        self.bad_evaluations, self._unsaved = saved["bad_evaluations"], saved["unsaved"]


def _lookup(records: Mapping[str, Any], path: tuple[str, ...], flat: str) -> Any:
    """``records["a"]["b"]`` for ``("a", "b")``, else ``records["a/b"]``, else None."""
    value: Any = records
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return records.get(flat)
        value = value[key]
    return value
