"""Process-group helpers for scripts that want them. The trainer never calls these: you set up
the process group and wrap the model, the trainer sequences (see ``examples/ddp.py``).

``init_distributed`` reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) or, under ``srun``, SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is
the first host of SLURM_JOB_NODELIST unless MASTER_ADDR is set).

Under torchrun's elastic restarts (``--max-restarts``) every attempt's workers meet in the same
launcher store. Its keys outlive the workers that wrote them, so a restarted worker may read the
previous attempt's addresses (gloo: ``connectFullMesh failed ... Connection refused``; the root
cause is discussed in pytorch/pytorch#135712) or wait for a peer that is gone. So each attempt
gets a store of its own: the launcher's, under the prefix ``trainfsm/restart_<N>/`` where N is
``TORCHELASTIC_RESTART_COUNT``, the same on every worker of one attempt and new for each.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, TCPStore

from trainfsm.torch_workarounds import import_collectives_before_any_group


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
    restart = elastic_restart()
    if restart is None:  # srun, or RANK/WORLD_SIZE set by hand: rank 0 hosts the store
        dist.init_process_group(
            backend,
            init_method=f"tcp://{layout.master_addr}:{layout.master_port}",
            rank=layout.rank,
            world_size=layout.world_size,
            timeout=timeout,
        )
        return layout
    dist.init_process_group(
        backend,
        store=PrefixStore(f"trainfsm/restart_{restart}/", _launcher_store(layout, timeout)),
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    return layout


def elastic_restart(environ: dict[str, str] | None = None) -> int | None:
    """torchrun's restart count for this attempt (0 for the first), or None outside torchrun."""
    value = (os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "")
    return int(value) if value.isdigit() else None


def _launcher_store(layout: DistEnv, timeout: timedelta) -> Any:
    """torchrun's store: the agent's own (a client on every worker) when the agent shares it, as
    torchrun does by default; otherwise rank 0 hosts one at MASTER_ADDR:MASTER_PORT, as
    ``init_process_group("env://")`` would."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return TCPStore(
        layout.master_addr,
        layout.master_port,
        layout.world_size,
        is_master=not agent and layout.rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )


def cleanup_distributed() -> None:
    """Destroy the default process group if there is one.

    A DDP model (its reducer) keeps the group alive after ``destroy_process_group``; if it is only
    collected during interpreter shutdown, gloo's threads end there and may abort the process
    (exit -6 after a clean run). So drop your references to the trainer and the wrapped model
    before calling this; the ``gc.collect()`` here frees what only reference cycles still hold.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


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
