"""``LoggingHook``: every ``interval`` steps, ``trainer.log(records)`` with the interval's averages.

(The module is ``logging_hook``, not ``logging``: a ``hooks/logging.py`` would be the ``logging``
that a script run from this directory, or a bare ``import logging`` resolved against it, gets.)

The records passed to ``trainer.log`` at ``trainer.step`` are ``trainloop``'s (0.5.x) layout, one
``"train"`` section of floats averaged over the interval (see ``trainfsm.hooks.stats``)::

    {"train": {**the user's records, nested as forward() returned them,
               "grad_norm": 2.3, "max_memory": 1.23,
               "loss": 0.52, "data_time": 0.01, "step_time": 0.25,
               "non_finite_grad_retry_count": 0.0,
               "lr": {"group_0": 0.001, "head": 0.0001}}}

``grad_norm`` is there when ``grad_clip`` is set (clipping computes it), ``max_memory`` (GiB, the
interval's peak) when a hook such as ``CudaMaxMemoryHook`` put it in ``step_info`` (in
``on_step_info``, which runs before this hook's ``on_after_step``). ``lr`` has one entry per param
group, named by the group's ``"name"`` or ``group_<i>``: the rate the interval's last step used
(read before the scheduler stepped). So wandb's and TensorBoard's keys are ``train/loss``,
``train/lr/group_0``, ``train/<record>``. A record named like one of the stats is replaced by it,
as in trainloop.

Logs at every ``interval``-th step and at the run's last step (completed, stopped or preempted),
so a run's tail is logged too. ``trainer.log`` is called on every rank (consumers such as
``WandbHook`` decide which rank writes); with ``sync=True`` all ranks log the same means, with
one collective per interval. The same numbers go to the audit trail as a ``metrics`` event
(``values``: the keys joined with ``/``), so ``trainfsm plot`` draws curves from the trail alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainfsm.hooks.stats import StatsHook, TrainingStats, flat

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer


class LoggingHook(StatsHook):
    """Average the step stats and records over ``interval`` steps and pass them to ``trainer.log``
    (trainloop 0.5.x's hook; a ``StatsHook``). The last, partial interval is logged too when a run
    stops or is preempted.

    Arguments:

    - ``interval`` (default 10): steps per logged average.
    - ``sync`` (default True): average across ranks first (one collective per interval; none when
      not distributed).
    """

    def __init__(self, interval: int = 10, sync: bool = True) -> None:
        super().__init__(interval=interval, sync=sync, param_group_keys=("name", "lr"))

    def on_stats(self, trainer: BaseTrainer, stats: TrainingStats) -> None:
        records = _records(stats)
        trainer.events.debug("metrics", values=flat(records))  # host floats already: no sync
        trainer.log(records)


def _records(stats: TrainingStats) -> dict[str, Any]:
    section: dict[str, Any] = dict(stats.records)
    if stats.grad_norm is not None:
        section["grad_norm"] = stats.grad_norm
    if stats.cuda_max_memory is not None:
        section["max_memory"] = stats.cuda_max_memory
    section["loss"] = stats.loss
    section["data_time"] = stats.data_time
    section["step_time"] = stats.step_time
    section["non_finite_grad_retry_count"] = stats.non_finite_grad_retries
    section["lr"] = {
        str(group.get("name", f"group_{i}")): group["lr"] for i, group in enumerate(stats.param_groups) if "lr" in group
    }
    return {"train": section}
