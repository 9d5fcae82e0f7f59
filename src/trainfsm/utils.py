"""Small helpers that are part of the public contract: ``map_nested_tensor``, ``key_average``,
``unwrap``."""

from __future__ import annotations

import copy
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

_PLAIN = frozenset({int, float, bool, str, bytes, type(None)})


def map_nested_tensor(f: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``f`` to every tensor in nested dicts, lists, tuples and named tuples.

    Containers keep their type (a ``defaultdict`` stays one, a named tuple keeps its fields);
    anything that is neither a tensor nor a container is returned as is.

    A state dict's own containers (dict, ``OrderedDict``, list, tuple) are built directly: an
    asynchronous save maps its state with this while the loop waits, after a step that left the
    CPU's caches cold. An ``OrderedDict`` keeps its attributes, as a copy would
    (``model.state_dict()``'s ``_metadata``); the types of a tuple are checked in C (Python's
    random state is 625 ints).
    """
    kind = type(obj)
    if kind is dict:
        return {key: map_nested_tensor(f, value) for key, value in obj.items()}
    if kind is OrderedDict:
        ordered = OrderedDict((key, map_nested_tensor(f, value)) for key, value in obj.items())
        ordered.__dict__.update(obj.__dict__)
        return ordered
    if kind is list:
        return [map_nested_tensor(f, value) for value in obj]
    if kind is tuple:  # nothing to map, and immutable: returned as it is
        return obj if set(map(type, obj)) <= _PLAIN else tuple(map_nested_tensor(f, value) for value in obj)
    if kind in _PLAIN:
        return obj
    if isinstance(obj, torch.Tensor):
        return f(obj)
    if isinstance(obj, Mapping):
        mapped = {key: map_nested_tensor(f, value) for key, value in obj.items()}
        try:  # a shallow copy keeps the type and its settings (a defaultdict's factory)
            out: Any = copy.copy(obj)
            out.clear()
            out.update(mapped)
            return out
        except (TypeError, AttributeError):  # a read-only mapping: a plain dict instead
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_nested_tensor(f, value) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_nested_tensor(f, value) for value in obj)
    return obj


def key_average(records: Sequence[Mapping[str, Any]], exclude_nan: bool = False) -> dict[str, Any]:
    """Average each leaf over the dicts that have it: nested dicts are averaged key by key.

    >>> key_average([{"loss": 1.0, "m": {"acc": 0.5}}, {"loss": 3.0, "m": {"acc": 1.0}}])
    {'loss': 2.0, 'm': {'acc': 0.75}}

    As ``trainloop``'s: keys come out sorted; a key missing from some dicts, or None there, is
    averaged over the dicts that have a value; with ``exclude_nan`` NaN values are left out too;
    a key with no value left averages to NaN. Tensors are averaged as tensors, without a host
    sync (with ``exclude_nan``, by ``torch.nanmean``).
    """
    leaves: dict[tuple[str, ...], list[Any]] = {}
    for record in records:
        _leaves(record, (), leaves)
    out: dict[str, Any] = {}
    for path in sorted(leaves):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise TypeError(
                    f"key_average: {'/'.join(path[:-1])!r} is a number in one record and a dict in another."
                )
        node[path[-1]] = _average([v for v in leaves[path] if v is not None], exclude_nan)
    return out


def _leaves(record: Mapping[str, Any], prefix: tuple[str, ...], into: dict[tuple[str, ...], list[Any]]) -> None:
    for key, value in record.items():
        path = (*prefix, key)
        if isinstance(value, Mapping):
            _leaves(value, path, into)
        else:
            into.setdefault(path, []).append(value)


def _average(values: list[Any], exclude_nan: bool) -> Any:
    if exclude_nan:
        if any(isinstance(v, torch.Tensor) for v in values):
            device = next(v.device for v in values if isinstance(v, torch.Tensor))
            stacked = torch.stack([torch.as_tensor(v, device=device).float().reshape(()) for v in values])
            return torch.nanmean(stacked)  # on the device: no host sync
        values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return float("nan")
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total / len(values)


def _wrapper_types() -> tuple[type, ...]:
    from torch.nn.parallel import DataParallel, DistributedDataParallel
    from torch.optim.swa_utils import AveragedModel

    types: list[type] = [DataParallel, DistributedDataParallel, AveragedModel]
    fsdp = _fsdp_module()
    if fsdp is not None:
        types.append(fsdp.FullyShardedDataParallel)
    return tuple(types)


def _compiled_type() -> type | None:
    """``torch.compile``'s wrapper class if dynamo was imported (compiling imports it), else None:
    touching ``torch._dynamo`` just to ask imports it and half of torch.distributed with it."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _fsdp_module() -> Any:
    """``torch.distributed.fsdp`` if the program imported it, else None.

    A model can only be FSDP-wrapped if its author imported FSDP; importing it here just to ask
    would load ~600 modules (and add ~0.15 s to every interpreter exit) for everyone else.
    """
    return sys.modules.get("torch.distributed.fsdp")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under ``torch.compile``, DDP, DataParallel, FSDP and ``AveragedModel``."""
    wrappers = _wrapper_types()
    compiled = _compiled_type()
    while True:
        if compiled is not None and isinstance(model, compiled):
            model = cast(nn.Module, model._orig_mod)
        elif isinstance(model, wrappers):
            model = cast(nn.Module, model.module)
        else:
            return model


def is_distributed_wrapper(model: nn.Module) -> bool:
    """True for DDP and FSDP (wrapper or ``fully_shard``) models: their forward takes part in
    collectives, so skipping it on one rank (``loss=None``) needs care."""
    from torch.nn.parallel import DistributedDataParallel

    compiled = _compiled_type()
    if compiled is not None and isinstance(model, compiled):
        model = cast(nn.Module, model._orig_mod)
    if isinstance(model, DistributedDataParallel):
        return True
    fsdp = _fsdp_module()
    if fsdp is None:
        return False
    return isinstance(model, (fsdp.FullyShardedDataParallel, fsdp.FSDPModule))


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 parameters and gradients, a shard of a sharded save);
    any other tensor itself. Duck-typed, so nothing of ``torch.distributed`` is imported for it."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and hasattr(tensor, "placements") else tensor


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel for the first frame outside trainfsm: the user's ``train()`` call
    (the machine's dispatch lies between the warning and it, at a depth that depends on the caller)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "trainfsm":
        frame = frame.f_back
        level += 1
    return level
