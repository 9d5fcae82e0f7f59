"""Process-group helpers for scripts that want them. The trainer never calls these: you set up
the process group and wrap the model, the trainer sequences (see ``examples/ddp.py``).

``init_distributed`` reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) or, under ``srun``, SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is
the first host of SLURM_JOB_NODELIST unless MASTER_ADDR is set).

Under torchrun's elastic restarts (``--max-restarts``) every attempt's workers meet in the same
launcher store, and its keys outlive the workers that wrote them: a restarted worker that read the
previous attempt's keys would dial the dead workers' addresses (gloo: ``connectFullMesh failed ...
Connection refused``; pytorch/pytorch#135712) or wait for a peer that is gone. So each restarted
group needs keys of its own, and every node must agree which.

``TORCHELASTIC_RESTART_COUNT`` cannot name them across nodes: each agent counts only its own
workers' failures. When a worker dies on node A, A's agent counts a restart; B's agent sees a node
waiting, stops its healthy workers and restarts them without counting one (torch decrements its
remaining restarts only on a failure). A's new workers say 1, B's say 0, and a B worker that
trusted its 0 would read the first attempt's keys. Only the store is common to every node, so the
group's number comes from the store (``_join_group``): rank 0 of each new group takes a fresh
number with an atomic ``add``; the other ranks learn it through keys that no earlier group can
have written (their own random nonce, or the "next" pointer rank 0 leaves on the previous number).
This relies on one thing torchrun guarantees: a new round's workers start only after every agent
has stopped the previous round's, so no old worker writes while a new group forms. The group's
keys then live under ``trainfsm/group_<N>/`` and old keys are never read.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, TCPStore

from trainfsm.preemption import torchelastic
from trainfsm.torch_workarounds import import_collectives_before_any_group, release_destroyed_groups


@dataclass(frozen=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol show hostnames`` when available."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        shown = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
        if shown.returncode == 0 and shown.stdout.strip():
            return shown.stdout.split()[0]
    match = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist)  # "node[01-04],gpu7" -> node01
    if match is None:
        raise ValueError(f"cannot read the first host of SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR.")
    return match.group(1) + (match.group(2) or "")


def read_env(environ: dict[str, str] | None = None) -> DistEnv | None:
    """The distributed layout from torchrun's or SLURM's variables; None outside both."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0"))
    else:
        return None
    addr = env.get("MASTER_ADDR") or (
        _first_host(env["SLURM_JOB_NODELIST"]) if "SLURM_JOB_NODELIST" in env else "127.0.0.1"
    )
    port = int(env.get("MASTER_PORT", "29500"))
    return DistEnv(rank, world, local, addr, port)


def init_distributed(backend: str | None = None, timeout: timedelta = timedelta(minutes=10)) -> DistEnv | None:
    """Initialise the default process group from the environment; None (and nothing done) outside
    torchrun/srun. ``backend`` defaults to nccl with CUDA, else gloo. ``timeout`` bounds how long a
    collective waits for a dead peer before every rank fails instead of hanging."""
    layout = read_env()
    if layout is None:
        return None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(layout.local_rank)
    import_collectives_before_any_group()  # now or never: the group exists from the next line (see there)
    restart = torchelastic.restart_count()
    if restart is None:  # srun, or RANK/WORLD_SIZE set by hand: rank 0 hosts the store
        dist.init_process_group(
            backend,
            init_method=f"tcp://{layout.master_addr}:{layout.master_port}",
            rank=layout.rank,
            world_size=layout.world_size,
            timeout=timeout,
        )
        return layout
    store = _launcher_store(layout, timeout)
    number = _join_group(store, layout.rank, layout.world_size, timeout)
    torchelastic.joined_group(number)  # a fact about this process, which the trail's run_start reports
    dist.init_process_group(
        backend,
        store=PrefixStore(f"{_GROUPS}_{number}/", store),
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    return layout


#: The launcher store's counter of groups formed under one torchrun launch (see the module's docstring).
_GROUPS: Final = "trainfsm/group"
#: The group number's accessor, kept here under its old name (``trainfsm.preemption.torchelastic``).
elastic_group = torchelastic.group
#: torchrun's restart count, kept here under its old name.
elastic_restart = torchelastic.restart_count


def _join_group(store: Any, rank: int, world: int, timeout: timedelta) -> int:
    """Agree with every rank of this group on a number no earlier group of the store has used.

    Rank 0 takes the next number ``N`` (an atomic ``add``) and leaves ``group/N-1/next = N`` for
    ranks that read the counter before it moved. Every other rank registers a fresh random nonce
    under the number it read and waits until rank 0 acknowledges exactly that nonce (a key nobody
    wrote before), or until the number it read points on to the next one, where it registers again.
    Keys of earlier groups may still be there, but none of them can ever be mistaken for this
    group's: the acknowledgement names the nonce and the "next" pointer names the new number.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        number = int(store.add(_GROUPS, 1))
        store.set(f"{_GROUPS}/{number - 1}/next", str(number))
        joined = [f"{_GROUPS}/{number}/rank{r}" for r in range(1, world)]
        if joined:
            store.wait(joined, timeout)
        for key in joined:
            store.set(f"{_GROUPS}/{number}/ack/{store.get(key).decode()}", "1")
        return number
    nonce = uuid.uuid4().hex
    number = int(store.add(_GROUPS, 0))  # this group's number, or the previous one's if rank 0 is late
    while True:
        store.set(f"{_GROUPS}/{number}/rank{rank}", nonce)
        onward = f"{_GROUPS}/{number}/next"
        if _acknowledged(store, f"{_GROUPS}/{number}/ack/{nonce}", onward, deadline):
            return number
        number = int(store.get(onward))


def _acknowledged(store: Any, ack: str, onward: str, deadline: float) -> bool:
    """True once ``ack`` is set, False once ``onward`` is (rank 0 took a newer number)."""
    pause = 0.005
    while not store.check([ack]):
        if store.check([onward]):
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"waited for rank 0 to form torchrun's new group ({onward.rsplit('/', 2)[0]}) in the launcher "
                "store until init_distributed's timeout: is rank 0 running?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.2)  # startup only: a few polls, gentle on a store that many ranks share
    return True


def _launcher_store(layout: DistEnv, timeout: timedelta) -> Any:
    """torchrun's store: the agent's own (a client on every worker) when the agent shares it, as
    torchrun does by default; otherwise rank 0 hosts one at MASTER_ADDR:MASTER_PORT, as
    ``init_process_group("env://")`` would."""
    agent = torchelastic.uses_agent_store()
    return TCPStore(
        layout.master_addr,
        layout.master_port,
        layout.world_size,
        is_master=not agent and layout.rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )


def cleanup_distributed() -> None:
    """Destroy the default process group if there is one, and let its threads end now.

    A DDP model (its reducer) keeps the group alive after ``destroy_process_group``; if it is only
    collected during interpreter shutdown, or never, gloo's threads run into shutdown and may abort
    the process (exit -6 after a clean run). After FSDP2 (``fully_shard``) torch's device meshes
    hold the destroyed group the same way, and DTensor's sharding cache holds the meshes until
    interpreter shutdown. ``release_destroyed_groups`` drops the destroyed group from every live
    DDP model and mesh (see ``trainfsm.torch_workarounds``), so gloo's threads end here even while
    you still hold the trainer; the ``gc.collect()`` first frees what only reference cycles held.
    A DDP model cannot all-reduce after this; its parameters and ``state_dict()`` stay.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        release_destroyed_groups()


STRATEGIES = ("none", "ddp", "fsdp")


def wrap_model(model: nn.Module, strategy: str = "ddp", device: torch.device | None = None, **kwargs: Any) -> nn.Module:
    """``"none"``: the model; ``"ddp"``: DistributedDataParallel; ``"fsdp"``: ``fully_shard`` (FSDP2)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}.")
    if strategy == "none":
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f'wrap_model(strategy="{strategy}") needs a process group: call init_distributed() first.')
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device is not None and device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **kwargs)
    from torch.distributed.fsdp import fully_shard

    return cast(nn.Module, fully_shard(model, **kwargs))
