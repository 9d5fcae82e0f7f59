"""``ProgressHook``: one line per interval on rank 0's stdout.

::

    Step   100/10000: step 0.2500s data 0.0100s eta 6:00:00 loss 0.5234 grad_norm 2.3456 lr_0 1.00e-03

Fields, each averaged over the interval (see ``trainfsm.hooks.stats``): ``step`` and ``data``
seconds per step; ``eta`` as ``H:MM:SS`` (hours may exceed 24), or ``eta -`` until it is known;
``mem`` (the interval's peak GiB, only when a hook such as ``CudaMaxMemoryHook`` put
``step_info["max_memory"]`` there, wherever it is listed); ``loss``; ``grad_norm`` (only with ``grad_clip``, which
computes it); then per param group each of its ``param_group_keys`` but ``name`` (default: the
rate), as ``<key>_<group>`` where the group is its ``"name"`` or its index: ``lr_0 1.00e-03``,
``lr_head 1.00e-04``, with ``param_group_keys=("lr", "momentum")`` also ``momentum_0 9.00e-01``;
the values the interval's last step used. With ``with_records`` the user's records follow after
`` | `` as ``key value`` pairs, nested keys joined by ``/``, values with 4 decimals (``.3e`` below
0.001 or from 100000 on, where 4 decimals would hide the value or flood the line).
``show_units=False`` drops the ``s`` and ``GiB`` suffixes. Retries are not on the line: each one
is already a ``non_finite`` warning on the console.

The line goes through ``print(..., flush=True)``, not the trainer's logger: it is the progress
display, which the contract puts on stdout, and a library must not configure logging handlers,
so through an unconfigured ``logging`` INFO would print nothing. Decision events (checkpoints,
retries, signals) are on the trainer's logger already.

ETA: the wall-clock rate since this attempt's ``eta_warmup``-th step, times the steps left. The
first steps (compilation, cache warm-up, a checkpoint load) run slower and would mislead it. The
warm-up counts steps of this attempt, so a resumed run waits ``eta_warmup`` steps again and never
divides by steps it did not time; nothing needs saving for that. A line is printed at every
``interval``-th step and at the run's last step (completed, stopped or preempted), so the tail of
a run is never lost; the first interval after a resume averages the steps it saw.

State: none worth saving. Only rank 0 prints; with ``sync=False`` the other ranks do no work at
all, with ``sync=True`` they take part in the interval's one collective.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainfsm import options as check
from trainfsm.hooks.stats import StatsHook, TrainingStats, flat

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer


class ProgressHook(StatsHook):
    """Print a progress line every ``interval`` steps (and at the last step) on rank 0: step, times,
    ETA, loss, the gradient norm (with ``grad_clip``), learning rates.

    Arguments:

    - ``interval`` (default 1): steps between lines.
    - ``with_records`` (default False): append the user's records, averaged over the interval.
    - ``sync`` (default False): average across ranks first (one collective per interval).
    - ``eta_warmup`` (default 10): steps of this attempt before the ETA is shown.
    - ``show_units`` (default True): print ``s`` / ``GiB`` after times and memory.
    - ``param_group_keys`` (default ``("name", "lr")``): which optimizer param-group values follow the
      loss (``lr_0 1.00e-03``, ``lr_<name>`` for a named group; ``"momentum"`` adds ``momentum_0``).
    """

    def __init__(
        self,
        interval: int = 1,
        with_records: bool = False,
        sync: bool = False,
        eta_warmup: int = 10,
        show_units: bool = True,
        param_group_keys: Sequence[str] = ("name", "lr"),
    ) -> None:
        self.with_records = check.boolean("ProgressHook with_records", with_records)
        self._with_records = self.with_records
        super().__init__(interval=interval, sync=sync, param_group_keys=param_group_keys)
        self.eta_warmup: int = check.positive_int(  # type: ignore[assignment]
            "ProgressHook eta_warmup", eta_warmup, minimum=0
        )
        self.show_units = check.boolean("ProgressHook show_units", show_units)
        self._seconds = "s" if show_units else ""
        self._gib = "GiB" if show_units else ""
        self._clock = time.perf_counter
        self._prints = True  # is this rank the one that prints
        self._step = 0
        self._max_steps = 0
        self._width = 1
        self._eta_step = 0  # the step after which the ETA clock starts
        self._eta_start: float | None = None

    def collects(self, trainer: BaseTrainer) -> bool:
        self._prints = trainer.rank == 0
        return self._prints or self.sync  # without sync the other ranks do no work at all

    def on_before_train(self, trainer: BaseTrainer) -> None:
        super().on_before_train(trainer)
        self._max_steps = trainer.max_steps
        self._width = len(str(trainer.max_steps))
        self._eta_step = trainer.step + self.eta_warmup
        self._eta_start = self._clock() if self.eta_warmup == 0 else None

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self._eta_step and self._active:
            self._eta_start = self._clock()
        super().on_after_step(trainer)

    def on_stats(self, trainer: BaseTrainer, stats: TrainingStats) -> None:
        if self._prints:
            print(self.format(stats, trainer.step), flush=True)

    def format(self, stats: TrainingStats, step: int) -> str:
        """The progress line for ``stats`` at ``step`` (ETA as of now)."""
        s = self._seconds
        parts = [
            f"Step {step:>{self._width}}/{self._max_steps}:",
            f"step {stats.step_time:.4f}{s}",
            f"data {stats.data_time:.4f}{s}",
            f"eta {self._eta(step)}",
        ]
        if stats.cuda_max_memory is not None:
            parts.append(f"mem {stats.cuda_max_memory:.2f}{self._gib}")
        parts.append(f"loss {stats.loss:.4f}")
        if stats.grad_norm is not None:
            parts.append(f"grad_norm {stats.grad_norm:.4f}")
        for i, group in enumerate(stats.param_groups):
            label = group.get("name", i)
            parts.extend(
                f"{key}_{label} {value:.2e}" if isinstance(value, numbers.Real) else f"{key}_{label} {value}"
                for key, value in group.items()
                if key != "name"
            )
        line = " ".join(parts)
        if self.with_records:
            records = flat(stats.records)
            if records:
                line += " | " + " ".join(f"{key} {_number(value)}" for key, value in records.items())
        return line

    def _eta(self, step: int) -> str:
        start = self._eta_start
        if start is None or step <= self._eta_step:
            return "-"
        per_step = (self._clock() - start) / (step - self._eta_step)
        return clock_format(per_step * (self._max_steps - step))


def _number(value: float) -> str:
    """A record's value: 4 decimals like the loss, scientific where those would hide it."""
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"


def clock_format(seconds: float) -> str:
    """``H:MM:SS``, hours unbounded: ``clock_format(108000) == "30:00:00"``."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
