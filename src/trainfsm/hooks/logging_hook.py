"""``LoggingHook``: every ``interval`` steps, ``trainer.log(records)`` with the interval's averages.

(The module is ``logging_hook``, not ``logging``: a ``hooks/logging.py`` would be the ``logging``
that a script run from this directory, or a bare ``import logging`` resolved against it, gets.)

The records passed to ``trainer.log`` at ``trainer.step``, each a float averaged over the interval
(see ``trainfsm.hooks.stats``)::

    {"loss": 0.52, "grad_norm": 2.3, "data_time": 0.01, "step_time": 0.25,
     "non_finite_grad_retries": 0.0, "max_memory": 1.23, "lr_0": 0.001, "lr_1": 0.0001,
     **the user's records, nested as forward() returned them}

``grad_norm`` is there when ``grad_clip`` is set (clipping computes it), ``max_memory`` when a hook
such as ``CudaMaxMemoryHook`` put it in ``step_info`` before this hook's ``on_after_step``. Nested
records stay nested, as ``trainer.log``'s contract has them; each consumer flattens in its own
convention (TensorBoard tags with ``/``, wandb's sections). A record named like one of the stats
replaces it: the user chose that name, and in the usual case (``records["loss"] = loss.item()``)
the two are the same number.

Logs at every ``interval``-th step and at the run's last step (completed, stopped or preempted),
so a run's tail is logged too. ``trainer.log`` is called on every rank (consumers such as
``WandbHook`` decide which rank writes); with ``sync=True`` all ranks log the same means, with
one collective per interval. State: none worth saving; the first interval after a resume
averages the steps this attempt ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainfsm import validation as check
from trainfsm.hooks.base import BaseHook
from trainfsm.hooks.stats import IntervalStats

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer


class LoggingHook(BaseHook):
    """Average the step stats and records over ``interval`` steps and pass them to ``trainer.log``.

    ``sync``: average across ranks first (one collective per interval; no collective when not
    distributed).
    """

    def __init__(self, interval: int = 10, sync: bool = True) -> None:
        self.interval: int = check.positive_int("LoggingHook interval", interval)  # type: ignore[assignment]
        self.sync = check.boolean("LoggingHook sync", sync)
        self._stats = IntervalStats("LoggingHook", sync=self.sync)
        self._add = self._stats.add
        self._add_lrs = self._stats.add_lrs

    def on_before_train(self, trainer: BaseTrainer) -> None:
        self._stats.start(trainer)

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        self._add_lrs()

    def on_after_step(self, trainer: BaseTrainer) -> None:
        self._add(trainer.step_info)
        step = trainer.step
        if step % self.interval == 0 or trainer.exit_reason is not None:
            summary = self._stats.summarize(step)  # the interval's host sync (and collective)
            scalars = summary.scalars()
            records: dict[str, Any] = {**scalars, **summary.records}
            # The interval's averages go to the trail too (host floats already: no extra sync), so
            # `trainfsm plot` can draw loss and learning-rate curves from the trail alone.
            trainer.audit.debug("metrics", values={**scalars, **summary.flat_records()})
            trainer.log(records)
