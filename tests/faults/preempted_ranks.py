"""Ranks of a SLURM job in a partition that preempts with a grace time, under a stand-in
``scontrol`` (tests/fake_slurm.py, set up by the test: ``FAKE_SLURM``, ``SLURM_JOB_ID``, PATH).
Rank 0 alone reads the job; the test sets a ``PreemptTime`` once every rank trains.

    python tests/faults/preempted_ranks.py --rank R --world W --port P --workspace DIR [--exit-wait S]
        W gloo ranks, each its own process (as srun tasks are), with --port for the rendezvous
    torchrun ... tests/faults/preempted_ranks.py --workspace DIR --no-requeue
        torchrun's workers (the process group from its environment)

Each rank trains a linear model under DDP, 20 ms a step, with SIGTERM and SIGUSR1 as exit signals.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--exit-wait", type=float, default=0.0)
    parser.add_argument("--no-requeue", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from trainfsm import BaseTrainer, CheckpointingHook

    if args.port is not None:
        init = f"tcp://127.0.0.1:{args.port}"
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world, init_method=init)
    else:  # torchrun's environment
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()

    class Trainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            g = torch.Generator().manual_seed(rank)
            return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(10)]

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            return DistributedDataParallel(nn.Linear(4, 1))

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=0.01)  # type: ignore[union-attr]

        def build_hooks(self) -> list[Any]:
            signals = [signal.SIGTERM, signal.SIGUSR1]
            requeue = False if args.no_requeue else "auto"
            return [CheckpointingHook(interval=1000, exit_signals=signals, exit_wait=args.exit_wait, requeue=requeue)]

        def forward(self, input: Any) -> Any:
            time.sleep(0.02)
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}

    Trainer(max_steps=100_000, workspace=args.workspace, device="cpu").train()


if __name__ == "__main__":
    main()
