"""The model's and optimizer's state dicts in torch.distributed.checkpoint's format, built directly
for a model that nothing shards: what ``get_state_dict`` returns with default options, at the
cost of ``model.state_dict()`` and ``optimizer.state_dict()``.

Why: ``get_state_dict`` (torch 2.13) checks its options, walks the model for FSDP modules and
looks up each parameter's fully qualified name again at every call. That costs about 50 µs a
parameter here (1.2 ms for 24, 6.8 ms for 200), and an asynchronous save blocks the loop for all
of it: with a 200 MB model of 12 layers it was 1.2 ms of the 1.7 ms the loop waited, against the
1% of a synchronous save (0.12 s) that such a save may block. The names do not change between
saves, so they are looked up once per model (``_get_fqns``, torch's own) and kept; so is the name
of each of the optimizer's parameters, while the optimizer has the same parameters and the model
state the same keys. Where ``optimizer.state_dict()`` is torch's own and has no hooks, its state
and groups are built under those names at once, not packed by number and renamed.

The loop waits for all of this in an asynchronous save, after a step that left the CPU's caches
cold, where every object touched costs: about 0.3 ms for the 12-layer model with momentum, of which
``model.state_dict()`` is half.

Used where torch would do nothing more than rename: no DTensor parameter or buffer (FSDP2,
tensor parallel), no older FSDP wrapper, default options (no full or offloaded state dict, no
frozen parameters left out, nothing flattened), and a model state that is not empty (torch
refuses that). An optimizer without state gets its param groups and no step (where torch would
step it first: ``torch_workarounds``). DDP and ``torch.compile`` prefixes are dropped as torch
drops them. ``tests/test_plain_state.py`` checks the result against ``get_state_dict``'s for each
kind of model and optimizer it serves.
"""

from __future__ import annotations

import weakref
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import nn

#: model -> state dict key -> torch's name for it (parameters, buffers, extra states alike).
_names: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()

#: model -> the state dict keys last seen that are torch's names already (no DDP or compile prefix).
_unrenamed: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()

#: optimizer -> what its parameters were called at the last save: see ``_optimizer_names``.
_optimizer: weakref.WeakKeyDictionary[Any, _Named] = weakref.WeakKeyDictionary()


class _Named(NamedTuple):
    names: dict[str, str]  # the model's ``_names`` entry: the same model
    keys: Any  # the model state's keys then
    ids: tuple[int, ...]  # the optimizer's parameters then, in its groups' order
    params: list[Any]  # held, so that no other tensor takes one of those ids
    by_id: dict[int, str]  # the id of each parameter the model has -> torch's name for it


def plain_state_dicts(model: nn.Module, optimizer: Any, options: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``get_state_dict(model, optimizer, options=options)``'s result, or None where it must be
    torch's own (see the module doc)."""
    if options is not None:
        return None
    names = _names.get(model)
    if names is None:
        if not _unsharded(model):
            return None
        names = _names.setdefault(model, {})
    model_state = _renamed(model, model.state_dict(), names)
    if not model_state:
        return None
    named = _optimizer_names(model, optimizer, names, model_state.keys())
    if _plain_optimizer(optimizer):  # what optimizer.state_dict() packs, under names at once
        by_id = named.by_id
        state = {
            (by_id[id(key)] if isinstance(key, torch.Tensor) else key): value for key, value in optimizer.state.items()
        }
        groups = [
            {
                **{key: value for key, value in group.items() if key != "params"},
                "params": [by_id[id(p)] for p in group["params"]],
            }
            for group in optimizer.param_groups
        ]
    else:  # optimizer.state_dict() numbers the parameters in their groups' order: ``ids``
        name_of = {index: named.by_id[id_] for index, id_ in enumerate(named.ids) if id_ in named.by_id}
        saved = optimizer.state_dict()
        state = {name_of[index]: value for index, value in saved["state"].items()}
        groups = [{**group, "params": [name_of[index] for index in group["params"]]} for group in saved["param_groups"]]
    return model_state, {"state": state, "param_groups": groups}


def _plain_optimizer(optimizer: Any) -> bool:
    """``optimizer.state_dict()`` is torch's own and no hook changes what it returns."""
    return (
        type(optimizer).state_dict is torch.optim.Optimizer.state_dict
        and not getattr(optimizer, "_optimizer_state_dict_pre_hooks", True)
        and not getattr(optimizer, "_optimizer_state_dict_post_hooks", True)
    )


def _optimizer_names(model: nn.Module, optimizer: Any, names: dict[str, str], keys: Any) -> _Named:
    """The name of each of ``optimizer``'s parameters (by its id), kept from the last save while the same model has
    the same state keys and the optimizer the same parameters: a save comes after a step that
    left the CPU's caches cold, and walking the model's modules for the names again costs."""
    ids = tuple(id(param) for group in optimizer.param_groups for param in group["params"])
    last = _optimizer.get(optimizer)
    if last is not None and last.names is names and last.ids == ids and last.keys == keys:
        return last
    params = [param for group in optimizer.param_groups for param in group["params"]]
    mine = set(ids)
    by_id = {id(param): _name(model, key, names) for key, param in model.named_parameters() if id(param) in mine}
    named = _optimizer[optimizer] = _Named(names, frozenset(keys), ids, params, by_id)
    return named


def _unsharded(model: nn.Module) -> bool:
    """No DTensor anywhere in the model, and no FSDP wrapper of either kind: checked once per model
    (a model is sharded when it is built, before its first save)."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in model.modules()):
        return False
    if any(type(m).__name__.startswith("FSDP") for m in model.modules()):  # fully_shard's classes
        return False
    return not any(hasattr(t, "placements") for t in chain(model.parameters(), model.buffers()))


def _renamed(model: nn.Module, state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state`` under torch's names, in the order torch leaves them: a renamed key moves to the end.
    Keys seen before as torch's names already (a model without wrappers) are not looked at again."""
    unrenamed = _unrenamed.get(model)
    if unrenamed is not None and state.keys() <= unrenamed:
        return state
    for key in list(state):
        name = _name(model, key, names)
        if name != key:
            state[name] = state.pop(key)
    _unrenamed[model] = frozenset(key for key in state if names.get(key) == key)
    return state


def _name(model: nn.Module, key: str, names: dict[str, str]) -> str:
    name = names.get(key)
    if name is None:
        from torch.distributed.checkpoint.state_dict import _get_fqns

        found = _get_fqns(model, key)
        if len(found) != 1:  # pragma: no cover - only the older FSDP wrapper's flat parameters
            raise RuntimeError(f"{key!r} has {len(found)} names in torch's state dict, expected 1")
        name = names[key] = next(iter(found))
    return name
