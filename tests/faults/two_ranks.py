"""Two gloo ranks in separate processes; SIGUSR1 goes to rank 1 only. Both must save at the same
step and exit with 138, and neither may hang. Used by tests/test_distributed_signals.py.

    python tests/faults/two_ranks.py --workspace /tmp/two   # runs the scenario and prints a summary
    python tests/faults/two_ranks.py --workspace /tmp/two --fsdp-async   # FSDP2, async sharded saves
    python tests/faults/two_ranks.py --workspace /tmp/two --host-group   # the default group as NCCL's

With ``--host-group`` the default group reports no CPU backend, as NCCL's does, so the trainer
creates its gloo host group; each rank writes which group its asynchronous all-reduces (the
step-end signal agreement's) ran in to ``async_all_reduces.rank<N>.json``.

With ``scenario(..., slurm_env=...)`` no signal is sent: the ranks run in a SLURM job (that
environment: a stand-in scontrol, tests/fake_slurm.py) whose end comes before the work is done, and
rank 0's deadline must stop both (``job_end_margin=1``). Used by tests/test_deadline.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def child(
    rank: int,
    world: int,
    port: int,
    workspace: Path,
    agree: bool = False,
    fsdp_async: bool = False,
    job_end_margin: float | None = None,
    host_group: bool = False,
) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from trainfsm import BaseTrainer, CheckpointingHook

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=30)
    )
    groups: list[str] = []
    if host_group:
        default, all_reduce = dist.distributed_c10d._get_default_group(), dist.all_reduce
        dist.get_backend_config = lambda group=None: "cuda:nccl"

        def recording(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
            if async_op:
                groups.append("default" if group in (None, default) else dist.get_backend(group))
            return all_reduce(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = recording

    class Trainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            g = torch.Generator().manual_seed(rank)
            return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(10)]

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            if fsdp_async:  # split over the ranks: the signal's checkpoint is sharded, written in the background
                from torch.distributed.fsdp import fully_shard

                return fully_shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
            return DistributedDataParallel(nn.Linear(4, 1))

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=0.01)  # type: ignore[union-attr]

        def build_hooks(self) -> list[Any]:
            return [CheckpointingHook(interval=1000, exit_signals=[signal.SIGUSR1], async_save=fsdp_async)]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            time.sleep(0.02)
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    try:
        margin = "auto" if job_end_margin is None else job_end_margin
        Trainer(
            max_steps=500, workspace=workspace, device="cpu", loss_none_agreement=agree, job_end_margin=margin
        ).train()
    except SystemExit:
        dist.barrier()  # both ranks leave together: gloo may abort a rank whose peer tore down first
        raise
    finally:
        if host_group:
            (workspace / f"async_all_reduces.rank{rank}.json").write_text(json.dumps(groups))
        gc.collect()  # the trainer's DDP model holds the group: free it before the group is destroyed
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def events(workspace: Path, rank: int) -> list[dict[str, Any]]:
    from trainfsm.trail.reader import TrailError, read_events

    try:
        return list(read_events(workspace, rank))
    except TrailError:  # no trail yet
        return []


def scenario(
    workspace: Path,
    timeout: float = 90.0,
    agree: bool = False,
    fsdp_async: bool = False,
    slurm_env: dict[str, str] | None = None,
    host_group: bool = False,
) -> dict[str, Any]:
    """Run it; returns exit codes per rank, and which ranks hung (killed after ``timeout``).
    ``agree``: ``loss_none_agreement=True``, so the signal rides on the per-micro-batch agreement.
    ``fsdp_async``: an FSDP2 model and ``async_save``, so the checkpoint is sharded and written on
    each rank's writer thread (EXIT must wait for it). ``slurm_env``: run in that SLURM job
    environment and send no signal: the job's end must stop the ranks. ``host_group``: the default
    group looks like NCCL's (no CPU backend), see ``--host-group``."""
    port = _free_port()
    extra = (["--agree"] if agree else []) + (["--fsdp-async"] if fsdp_async else [])
    extra += ["--host-group"] if host_group else []
    extra += ["--job-end-margin", "1"] if slurm_env is not None else []
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE),
                "--child",
                str(rank),
                "--port",
                str(port),
                "--workspace",
                str(workspace),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **(slurm_env or {})},
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + timeout
    while not all(any(e["event"] == "restore" for e in events(workspace, r)) for r in range(2)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    time.sleep(0.5)
    signalled_at = time.monotonic()
    if slurm_env is None:
        procs[1].send_signal(signal.SIGUSR1)
    codes: dict[int, int | None] = {}
    hung = []
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            codes[rank] = proc.returncode
        except subprocess.TimeoutExpired:
            hung.append(rank)
            proc.kill()
            proc.wait()
            codes[rank] = None
    stderr = {rank: proc.stderr.read().decode()[-2000:] if proc.stderr else "" for rank, proc in enumerate(procs)}
    return {"codes": codes, "hung": hung, "seconds": time.monotonic() - signalled_at, "stderr": stderr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--agree", action="store_true", help="loss_none_agreement=True")
    parser.add_argument("--fsdp-async", action="store_true", help="FSDP2 and async sharded saves")
    parser.add_argument("--job-end-margin", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host-group", action="store_true", help="a default group without a CPU backend")
    args = parser.parse_args()
    if args.child is not None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        child(
            args.child, 2, args.port, args.workspace, args.agree, args.fsdp_async, args.job_end_margin, args.host_group
        )
        return
    result = scenario(args.workspace, agree=args.agree, fsdp_async=args.fsdp_async, host_group=args.host_group)
    print(json.dumps({k: v for k, v in result.items() if k != "stderr"}))


if __name__ == "__main__":
    main()
