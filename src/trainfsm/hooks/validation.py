"""``ValidationHook``: evaluate every ``interval`` steps and log the results under a ``val`` namespace.

When: after the optimizer step of every ``interval``-th step, and after the last step
(``max_steps``) so the final weights are always evaluated. It runs at the step's *decision point*,
``on_evaluate``: after the step is applied and before the trainer asks the hooks ``wants_stop`` and
``wants_checkpoint``. That is the only place where a result can still change this step's decision:
an ``EarlyStoppingHook`` sees the value and can ask for a checkpoint of exactly these weights or
stop at this step, wherever it is in the hook list. (``on_after_step`` fires once the decision is
taken.) The trainer reads pending exit signals after the evaluation, so a signal that arrives
during one is acted on at this step.

How: ``model.eval()`` under ``torch.no_grad()`` (and the trainer's autocast when it uses mixed
precision); afterwards every submodule gets back the train/eval mode it had, and the random states
(Python, torch, CUDA, numpy) get back what they were, so a shuffling validation loader or random
augmentation does not change the training run: with or without validation, training is
bit-identical and resumes exactly.

What: ``evaluate(trainer, data_loader) -> dict``; the default runs ``trainer.forward`` on every
batch and returns the mean loss as ``loss`` plus the records averaged with ``key_average``. Scalar
tensors become floats (one host read per value per evaluation). With several ranks each rank
evaluates its own data and every number is replaced by the mean over ranks (one ``all_reduce``), so
every rank logs, and an early-stopping hook decides on, the same values; every rank must then
return the same keys. The results go to ``trainer.log({name: results})`` and stay in ``hook.last``
(with ``hook.last_step``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainfsm import collectives, rng
from trainfsm.hooks.base import BaseHook
from trainfsm.step import MIXED_PRECISION_DTYPES
from trainfsm.utils import key_average, map_nested_tensor

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

Evaluate = Callable[["BaseTrainer", Any], Mapping[str, Any]]


def average_forward(trainer: BaseTrainer, data_loader: Iterable[Any]) -> dict[str, Any]:
    """The default evaluation: ``trainer.forward`` on every batch; the mean loss and mean records."""
    losses: list[torch.Tensor] = []
    records: list[Mapping[str, Any]] = []
    for batch in data_loader:
        loss, batch_records = trainer.forward(batch)
        if loss is not None:
            losses.append(loss.detach().float())
        records.append(batch_records)
    if not records:
        raise RuntimeError(
            "ValidationHook: the validation data loader yielded no batches. Give a non-empty re-iterable "
            "(a DataLoader or a list), not a generator that is used up after the first evaluation."
        )
    results = key_average(records)
    if losses:
        results["loss"] = torch.stack(losses).mean()
    return results


class ValidationHook(BaseHook):
    """Run ``evaluate`` every ``interval`` steps and at the last step, at the step's decision point
    (``on_evaluate``: before ``wants_stop`` and ``wants_checkpoint`` are asked). It runs in eval
    mode under ``torch.no_grad()``, with the modules' modes and the random states put back
    afterwards, so training is the same with or without it. With several ranks every number is
    averaged over the ranks. The results go to ``trainer.log`` under ``name`` and stay in
    ``hook.last``. More in the module's docstring.

    Arguments:

    - ``interval`` (required): steps between evaluations.
    - ``data_loader`` (default None): the data, a re-iterable (a DataLoader or a list).
    - ``evaluate`` (default None: the mean ``loss`` of ``trainer.forward`` over every batch, and the
      averaged records): ``evaluate(trainer, data_loader)`` returning a dict of results. A custom
      one may do without data (it then receives None).
    - ``build_data_loader`` (default None): ``build_data_loader(trainer)``, called once at the first
      evaluation, instead of ``data_loader``.
    - ``name`` (default ``"val"``): the namespace of the results in ``trainer.log``.
    """

    def __init__(
        self,
        interval: int,
        data_loader: Iterable[Any] | None = None,
        evaluate: Evaluate | None = None,
        build_data_loader: Callable[[BaseTrainer], Iterable[Any]] | None = None,
        name: str = "val",
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"ValidationHook interval must be an int >= 1 (evaluate every that many steps); got {interval!r}."
            )
        if data_loader is not None and build_data_loader is not None:
            raise ValueError("ValidationHook takes data_loader or build_data_loader, not both.")
        if data_loader is not None and (not isinstance(data_loader, Iterable) or isinstance(data_loader, Iterator)):
            raise TypeError(
                f"ValidationHook data_loader must be a re-iterable such as a DataLoader or a list (it is iterated "
                f"at every evaluation); got {type(data_loader).__name__}."
            )
        for argument, value in (("evaluate", evaluate), ("build_data_loader", build_data_loader)):
            if value is not None and not callable(value):
                raise TypeError(f"ValidationHook {argument} must be callable or None; got {value!r}.")
        if evaluate is None and data_loader is None and build_data_loader is None:
            raise ValueError(
                "ValidationHook needs data to evaluate on: pass data_loader=..., build_data_loader=..., or a "
                "custom evaluate(trainer, data_loader) that finds its own data."
            )
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"ValidationHook name must be a non-empty str (the namespace in trainer.log); got {name!r}."
            )
        self.interval = interval
        self.data_loader = data_loader
        self.build_data_loader = build_data_loader
        self.evaluate: Evaluate = evaluate if evaluate is not None else average_forward
        self.name = name
        self.last: dict[str, Any] | None = None
        self.last_step: int | None = None
        self._autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    def on_before_train(self, trainer: BaseTrainer) -> None:
        dtype = MIXED_PRECISION_DTYPES[trainer.mixed_precision]
        if dtype is not None:  # evaluate the way forward runs in training (one object, re-entered)
            self._autocast = torch.autocast(device_type=trainer.device.type, dtype=dtype)

    def on_evaluate(self, trainer: BaseTrainer) -> None:
        """Evaluate at this step's decision point when it is due."""
        step = trainer.step
        if step % self.interval == 0 or step == trainer.max_steps:
            self.validate(trainer)

    def validate(self, trainer: BaseTrainer) -> dict[str, Any]:
        """Evaluate now, log the results under ``name`` and return them."""
        model = trainer.model
        if model is None:
            raise RuntimeError("ValidationHook.validate() needs the built model (call it once train() has built it).")
        modes = [(module, module.training) for module in model.modules()]
        random_state = rng.capture()  # before building the loader too: building may draw (a random split)
        model.eval()
        try:
            if self.data_loader is None and self.build_data_loader is not None:
                self.data_loader = self.build_data_loader(trainer)
            with torch.no_grad(), self._autocast:
                results = self.evaluate(trainer, self.data_loader)
        finally:
            for module, training in modes:  # each one as it was: a frozen submodule stays in eval
                module.training = training
            rng.restore(random_state)
        if not isinstance(results, Mapping):
            raise TypeError(f"ValidationHook evaluate must return a dict of results; got {type(results).__name__}.")
        results = map_nested_tensor(_scalar_to_float, dict(results))
        if trainer.world_size > 1:
            results = _mean_over_ranks(results, trainer.world_size, trainer.device)
        self.last, self.last_step = results, trainer.step
        trainer.log({self.name: results})
        return results


def _scalar_to_float(tensor: torch.Tensor) -> Any:
    return tensor.item() if tensor.numel() == 1 else tensor  # a host read: once per value per evaluation


def _numbers(results: Mapping[str, Any]) -> Iterator[float]:
    for value in results.values():
        if isinstance(value, Mapping):
            yield from _numbers(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield float(value)


def _replace_numbers(results: Mapping[str, Any], means: Iterator[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in results.items():
        if isinstance(value, Mapping):
            out[key] = _replace_numbers(value, means)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = next(means)
        else:
            out[key] = value
    return out


def _mean_over_ranks(results: dict[str, Any], world_size: int, device: torch.device) -> dict[str, Any]:
    """Every number in ``results`` replaced by its mean over the ranks: one ``all_reduce``."""
    packed = collectives.sum_over_ranks(torch.tensor(list(_numbers(results)), dtype=torch.float64, device=device))
    means = (packed / world_size).tolist()  # host read: once per evaluation
    return _replace_numbers(results, iter(means))
