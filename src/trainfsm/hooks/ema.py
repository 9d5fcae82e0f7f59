"""``EmaHook``: an exponential moving average of the model's weights, saved with the checkpoint.

The average is a ``torch.optim.swa_utils.AveragedModel`` of ``trainer.unwrapped_model`` (a deep copy
on the model's device) with ``get_ema_multi_avg_fn(decay)``: per step one fused
``ema += (1 - decay) * (weights - ema)`` over all parameters, and no device sync.

Why the hook does not call ``AveragedModel.update_parameters`` every step: it decides copy or average
with ``bool(self.n_averaged == 0)`` and ``if self.n_averaged > 0``, two host reads of a buffer on the
model's device, so two syncs per step on a GPU (``tests/test_host_syncs.py`` counted them). The
hook calls it for its first update of each attempt (the copy, or the first average after a resume,
whatever the loaded ``n_averaged``), and from then on, knowing the count is above zero, runs the
same updates itself: the same fused average per device and dtype, the same buffer copies, the same
``n_averaged += 1``, bit for bit.

When it is updated: in ``on_after_step``, once per completed optimizer step (a retried step reaches
``on_after_step`` once, after its successful attempt). As in ``AveragedModel``, the first update
copies the weights; each later one moves the average towards them. A step the fp16 grad scaler
skipped is averaged in too: its weights did not change, so the average takes one more step towards
the same weights, as timm's training script does. ``step_info`` does not tell a skipped step from an
applied one; if the trainer ever says so, leaving skipped steps out is one line here.

Where it lives: it is built from the model in ``on_before_train`` (after RESTORE), or earlier in
``on_load_state_dict`` when a checkpoint is loaded, so the loaded average fills it whatever the order
of the hooks. It is saved under ``state_dict[name]`` (the ``AveragedModel``'s state: parameters,
buffers, ``n_averaged``); a checkpoint without that key (saved before the hook was added) leaves the
average a fresh copy of the loaded weights.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainfsm.hooks.base import BaseHook

if TYPE_CHECKING:
    from collections.abc import Iterable

    from trainfsm.trainer import BaseTrainer


class EmaHook(BaseHook):
    """Keep ``hook.ema_model``, an ``AveragedModel`` of the model, updated after every optimizer step.

    Arguments:

    - ``decay`` (default 0.9999): the exponential moving average's decay per optimizer step.
    - ``use_buffers`` (default False): True averages buffers (BatchNorm statistics) as well; False
      copies the model's buffers as they are at each update (``AveragedModel``'s behaviour).
    - ``name`` (default ``"ema"``): the key of its state in the checkpoint (two EMA hooks need two
      names).
    """

    def __init__(self, decay: float = 0.9999, use_buffers: bool = False, name: str = "ema") -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EmaHook decay must be a number in [0, 1] (e.g. 0.999); got {decay!r}.")
        if not isinstance(use_buffers, bool):
            raise TypeError(f"EmaHook use_buffers must be True or False; got {use_buffers!r}.")
        if not isinstance(name, str) or not name:
            raise ValueError(f"EmaHook name must be a non-empty str (its key in the checkpoint); got {name!r}.")
        self.decay = float(decay)
        self.use_buffers = use_buffers
        self.name = name
        self.ema_model: AveragedModel | None = None
        self._average = get_ema_multi_avg_fn(self.decay)  # type: ignore[no-untyped-call]
        self._averaging = False  # n_averaged > 0, known on the host: updates need not read it

    def _built(self, trainer: BaseTrainer) -> AveragedModel:
        if self.ema_model is None:
            self.ema_model = AveragedModel(
                trainer.unwrapped_model, multi_avg_fn=self._average, use_buffers=self.use_buffers
            )
        return self.ema_model

    def on_before_train(self, trainer: BaseTrainer) -> None:
        self._built(trainer)
        self._averaging = False  # this attempt's first update asks n_averaged (loaded, or 0)

    def on_after_step(self, trainer: BaseTrainer) -> None:
        ema, model = self._built(trainer), trainer.unwrapped_model
        if not self._averaging:
            ema.update_parameters(model)  # reads n_averaged on the host: once per attempt
            self._averaging = True
            return
        self._update(ema, model)

    @torch.no_grad()
    def _update(self, ema: AveragedModel, model: torch.nn.Module) -> None:
        """``AveragedModel.update_parameters`` once ``n_averaged > 0``, without reading it."""
        averaged: Iterable[torch.Tensor] = ema.module.parameters()
        current: Iterable[torch.Tensor] = model.parameters()
        if self.use_buffers:
            averaged = itertools.chain(averaged, ema.module.buffers())
            current = itertools.chain(current, model.buffers())
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p_averaged, p_model in zip(averaged, current, strict=False):  # strict=False, as torch's
            target, source = p_averaged.detach(), p_model.detach()
            group = groups.setdefault((target.device, target.dtype), ([], []))
            group[0].append(target)
            group[1].append(source if source.device == target.device else source.to(target.device))
        for targets, sources in groups.values():
            self._average(targets, sources, ema.n_averaged)  # the EMA ignores the count
        if not self.use_buffers:  # keep the buffers as the model's, as AveragedModel does
            for b_averaged, b_model in zip(ema.module.buffers(), model.buffers(), strict=True):
                b_averaged.detach().copy_(b_model.detach())  # copy_ moves across devices itself
        ema.n_averaged += 1  # on its device: no sync

    def on_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        state_dict[self.name] = self._built(trainer).state_dict()

    def on_load_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get(self.name)
        if saved is not None:
            self._built(trainer).load_state_dict(saved)


EMAHook = EmaHook  # the other published spelling
