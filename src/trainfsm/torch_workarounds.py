"""Workarounds for torch behaviour that would otherwise hurt a run of ours; each says when it can go.

**A destroyed process group that stays alive.** ``torch.distributed.nn.functional`` takes
``group=group.WORLD`` as default arguments, evaluated once, when the module is first imported.
torch imports it lazily and often late: building the first optimizer imports ``torch._dynamo``,
which imports FSDP and with it this module. If that happens after ``init_process_group`` (the
order of every training script), the default group is captured in those defaults, and
``destroy_process_group()`` no longer frees it: gloo's worker threads run on into interpreter
shutdown. If one of them is still releasing the last collective's work item there, it needs the
GIL, the finalizing interpreter ends the thread, and C++ aborts the process: exit 134/-6,
"terminate called without an active exception", after a run that finished cleanly (seen in
about one in eight two-rank runs here, torch 2.13). Under torchrun or srun that marks the job
failed.

Importing the module before any group exists makes those defaults None (the default group at
call time), so nothing holds the group. trainfsm does that wherever its torch side is first
imported, which scripts do at the top, before they create their group: ``import trainfsm`` after
``import torch`` (the order isort gives), the first use of a name from it (``from trainfsm import
BaseTrainer``), importing ``trainfsm.trainer``, and ``trainfsm.distributed.init_distributed`` just
before it creates the group. ``import trainfsm`` alone, before torch, imports no torch (the offline
commands start in a fraction of a second for it). Costs about 0.08 s once. A script that creates
its group before any of those is told in BUILD (``GroupOutlivesDestroyWarning``, and the
``group_outlives_destroy`` event), since it can no longer be helped from here. Checked by
``tests/test_torch_workarounds.py``, which also shows when torch stops capturing the group (then
this can go).

**A destroyed group that a device mesh still holds.** In torch 2.13 every ``DeviceMesh`` keeps
the process groups of its dimensions in ``mesh._pg_registry`` (proposed in pytorch/pytorch#172272),
and FSDP2's meshes outlive the model: DTensor's sharding-propagation cache (the C++ fast path, one
per thread, the main thread's kept until interpreter shutdown) holds the ``DTensorSpec`` of every
op it has seen, and each spec its mesh (pytorch/pytorch#181761 reports such specs piling up;
NVIDIA/Megatron-LM#7029 found the cache holding meshes across process-group lifetimes). So after
``fully_shard`` (even before its first forward) ``destroy_process_group()`` frees no group: gloo's
threads run on into interpreter shutdown, with the abort above (134/-6 after a clean run, seen in
a resumed 2-rank FSDP2 launch under CPU load, torch 2.13). The registry is only read while
torch.compile traces, and a destroyed group is of no use there either. ``release_destroyed_groups()``,
called after ``destroy_process_group()``, drops such groups from every mesh: the last reference
goes, and gloo's threads end then, on the calling thread. Checked by ``tests/test_fsdp_teardown.py``,
which also shows when torch stops holding the group (then this can go).

**A destroyed group that a DDP model still holds.** ``DistributedDataParallel`` holds its group in
``process_group`` and in its C++ reducer (and the reducer's logger), so a script that calls
``destroy_process_group()`` (or ``cleanup_distributed()``) while it still refers to the trainer or
the wrapped model frees no group: gloo's threads run on into interpreter shutdown, and the group
goes only when shutdown collects the model, or never. A gloo thread still busy with a collective
then releases the work item's tensors while the interpreter is finalizing; their Python objects
need the GIL (``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` -> ``decref_pyobject`` ->
``take_gil``), the finalizing interpreter ends the thread, and C++ aborts the process: 134/-6
after a completed run, "terminate called without an active exception" (the stack of the core of
such a process; a group alive at exit with an ``all_reduce(async_op=True)`` in flight aborted 5
launches of 5 here; after a trainer's run the last collective is rarely that late, so it is rare,
more so under CPU load). ``release_destroyed_groups()`` drops the destroyed group from every live
DDP model too: its reducer and logger first, then ``process_group``, so the group's last reference
goes from its Python object, whose destructor releases the GIL while it joins gloo's threads. The
model can no longer all-reduce (it could not without its group either); its parameters,
``module`` and ``state_dict()`` stay. ``release_groups_at_exit()`` (the trainer calls it in BUILD
when a process group exists) runs it once more at the interpreter's exit, while every thread can
still take the GIL, and then collects the garbage (the trainer of a ``main()`` that returned): so
a script that ends with a plain ``destroy_process_group()`` and keeps its trainer has no gloo
thread left at shutdown. A group never destroyed is left alone (destroying it is the script's
call; with NCCL it can block). Checked by ``tests/test_exit_teardown.py``, which also shows when
torch stops holding the group (then this can go).

**A zero-gradient optimizer step at every save.** ``get_state_dict`` (torch 2.13) first makes sure
the optimizer has state: when it has none and no parameter holds a gradient, it gives every
parameter a zero gradient and runs ``optimizer.step()`` at a learning rate of 0. An optimizer that
never keeps state (SGD without momentum) pays that at every save: a gradient-sized allocation and
a step over every parameter (0.23 s per 200 MB save against 0.10 s with momentum, issue 35), and
the user's step hooks see a step that was not taken. An optimizer whose state appears at its first
step (Adam) gets state the run never had (step 1, zero moments) when a save comes before any real
step, as when a grad scaler skipped them all, and it trains differently from then on; loading such
a checkpoint does the same step. Without state there is nothing to initialise: the optimizer's state
dict is its param groups, so ``capture_model_and_optimizer`` builds it from
``optimizer.state_dict()`` in torch's format (parameters named as torch names them, flattened when
the options say so) and ``load_model_and_optimizer`` loads the groups without a step. Checked by
``tests/test_resume_optimizers.py``, which also shows when torch stops stepping (then this can go).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import sys
import warnings
from typing import Any, cast

import torch.distributed as dist

from trainfsm.plain_state import plain_state_dicts

COLLECTIVES_MODULE = "torch.distributed.nn.functional"
DEVICE_MESH_MODULE = "torch.distributed.device_mesh"
DDP_MODULE = "torch.nn.parallel.distributed"
#: What a DDP model holds its group by, dropped in this order: the group's last reference goes from its
#: Python object, whose destructor releases the GIL (see the module doc).
DDP_GROUP_HOLDERS = ("reducer", "logger", "process_group")


GROUP_KEPT_ALIVE = (
    "torch.distributed.nn.functional was imported after the default process group was created, and "
    "its default arguments now hold the group: destroy_process_group() will not free it, and gloo's "
    "threads can abort the process at exit (code 134, 'terminate called without an active exception') "
    "after a clean run. Import trainfsm before init_process_group (at the top of the script, after "
    "`import torch`, or as `from trainfsm import BaseTrainer`), or import torch.distributed.nn.functional "
    "yourself before creating the group."
)


class GroupOutlivesDestroyWarning(UserWarning):
    """The default process group is held by torch and will outlive ``destroy_process_group()``:
    the process may abort at exit (134) after a clean run. Import trainfsm before creating the group."""


def import_collectives_before_any_group() -> None:
    """Import ``torch.distributed.nn.functional`` now if no process group exists yet."""
    if dist.is_available() and not dist.is_initialized():
        importlib.import_module(COLLECTIVES_MODULE)


def default_group_kept_alive() -> bool:
    """Whether ``torch.distributed.nn.functional``'s default arguments hold the current default
    group (it was imported after the group was created), so that destroying the group frees nothing."""
    module = sys.modules.get(COLLECTIVES_MODULE)
    if module is None or not (dist.is_available() and dist.is_initialized()):
        return False
    world = dist.group.WORLD
    broadcast = getattr(module, "broadcast", None)
    return any(value is world for value in (getattr(broadcast, "__defaults__", None) or ()))


def capture_model_and_optimizer(model: Any, optimizer: Any, options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict`` of torch.distributed.checkpoint, without its zero-gradient optimizer step
    when the optimizer has no state (see the module doc). The older FSDP wrapper, whose optimizer
    state torch builds its own way, always goes through ``get_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    # First: for a model nothing shards (checked once per model, FSDP of either kind included) the
    # same state dicts without torch's per-call checks, nor a walk of the model here at every save.
    plain = plain_state_dicts(model, optimizer, options)
    if plain is not None:
        return plain
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by whoever wrapped a model in it
    older_fsdp = fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in model.modules())
    if optimizer.state or older_fsdp:
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        return model_state, optim_state
    return get_model_state_dict(model, options=options), _stateless_optimizer_state(model, optimizer, options)


def _stateless_optimizer_state(model: Any, optimizer: Any, options: Any) -> dict[str, Any]:
    """What ``get_optimizer_state_dict`` returns for an optimizer without state, made without a step:
    ``optimizer.state_dict()``'s param groups with each parameter's id replaced by the name torch
    gives it (``_get_fqns``: without the DDP, ``torch.compile`` and checkpoint-wrapper prefixes)."""
    from torch.distributed.checkpoint import state_dict as dsd

    names: dict[Any, str] = {}
    for key, param in model.named_parameters():
        fqns = dsd._get_fqns(model, key)
        if len(fqns) != 1:  # pragma: no cover - only the older FSDP wrapper's flat parameters
            raise RuntimeError(f"parameter {key!r} has {len(fqns)} names in torch's state dict, expected 1")
        names[param] = next(iter(fqns))
    params = [param for group in optimizer.param_groups for param in group["params"]]
    groups = [
        {**group, "params": [names[params[index]] for index in group["params"]]}
        for group in optimizer.state_dict()["param_groups"]
    ]
    state: dict[str, Any] = {"state": {}, "param_groups": groups}
    if options is not None and options.flatten_optimizer_state_dict:
        return cast(dict[str, Any], dsd._flatten_optim_state_dict(state))
    return state


def load_model_and_optimizer(model: Any, optimizer: Any, model_state: Any, optim_state: Any, options: Any) -> None:
    """``set_state_dict`` of torch.distributed.checkpoint, except for an optimizer state without
    per-parameter state (SGD without momentum, or any optimizer saved before its first step).

    Then torch would run the zero-gradient step first (see the module doc), and with a full state
    dict it cannot load it at all (it asserts "Expected device to be set", torch 2.13); its param
    groups are all there is, so they go through the optimizer's own ``load_state_dict``, matched in
    order as that does. Flattened states (``flatten_optimizer_state_dict``) go through torch."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if isinstance(optim_state.get("param_groups"), list) and not optim_state.get("state"):
        set_model_state_dict(model, model_state, options=options)
        ids = [group["params"] for group in optimizer.state_dict()["param_groups"]]
        saved = optim_state["param_groups"]
        if len(saved) != len(ids) or any(len(g["params"]) != len(i) for g, i in zip(saved, ids, strict=False)):
            raise ValueError(
                f"the checkpoint's optimizer has {len(saved)} parameter groups of "
                f"{[len(g['params']) for g in saved]} parameters, this optimizer {len(ids)} of "
                f"{[len(i) for i in ids]}: build the optimizer the checkpoint was saved from."
            )
        groups = [{**group, "params": own} for group, own in zip(saved, ids, strict=True)]
        optimizer.load_state_dict({"state": {}, "param_groups": groups})
        return
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)


def warn_if_group_kept_alive(log: Any) -> None:
    """Tell the user (a warning) and the trail (``group_outlives_destroy``) when the default group
    was created before the import above could help (see the module doc)."""
    if default_group_kept_alive():
        from trainfsm.utils import user_stacklevel

        log.warning("group_outlives_destroy", cause=GROUP_KEPT_ALIVE)
        warnings.warn(GROUP_KEPT_ALIVE, GroupOutlivesDestroyWarning, stacklevel=user_stacklevel())


def release_destroyed_groups() -> int:
    """Drop the process groups that ``destroy_process_group()`` has destroyed from what would keep
    them alive into interpreter shutdown (see the module doc): every live ``DeviceMesh`` and every
    live ``DistributedDataParallel``. How many references were dropped. Call it after
    ``destroy_process_group()``. Costs one pass over the objects the garbage collector tracks
    (about 0.1 s for 300,000, a small FSDP2 run here)."""
    mesh_type = getattr(sys.modules.get(DEVICE_MESH_MODULE), "DeviceMesh", None)
    ddp_type = getattr(sys.modules.get(DDP_MODULE), "DistributedDataParallel", None)
    if not dist.is_available() or (mesh_type is None and ddp_type is None):
        return 0  # no mesh and no DDP model was ever made in this process
    from torch.distributed import distributed_c10d

    live = {id(group) for group in distributed_c10d._world.pg_map}  # every group not destroyed yet
    dropped = 0
    for obj in gc.get_objects():
        # The MRO, not isinstance: DeviceMesh's metaclass runs Python code for every isinstance.
        mro = type(obj).__mro__
        if mesh_type is not None and mesh_type in mro:
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                for name, group in list(registry.items()):
                    if id(group) not in live:
                        del registry[name]
                        dropped += 1
        elif ddp_type is not None and ddp_type in mro:
            attributes = vars(obj)  # nn.Module keeps these plain attributes in its __dict__
            group = attributes.get("process_group")
            if group is not None and id(group) not in live:
                for name in DDP_GROUP_HOLDERS:
                    dropped += attributes.pop(name, None) is not None
    return dropped


_released_at_exit = False


def release_groups_at_exit() -> None:
    """Once per process: at the interpreter's exit (``atexit``, while every thread can still take
    the GIL), ``release_destroyed_groups()`` and collect the garbage, so that gloo's threads of a
    group the script destroyed end before shutdown even where the script still holds its trainer
    or model (see the module doc). The trainer's BUILD calls it when a process group exists."""
    global _released_at_exit
    if _released_at_exit or not (dist.is_available() and dist.is_initialized()):
        return
    _released_at_exit = True
    atexit.register(_release_at_exit)


def _release_at_exit() -> None:
    # Before collecting: gc.get_objects() sees the unreachable models too, and dropping a group
    # from Python releases the GIL while gloo's threads are joined; a collection that freed a
    # reducer holding a group's last reference would join them with the GIL held.
    release_destroyed_groups()
    gc.collect()
