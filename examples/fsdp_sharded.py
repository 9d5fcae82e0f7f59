"""FSDP2 (``fully_shard``) with sharded checkpoints: every rank saves and loads only its own shards.

    torchrun --nproc-per-node 2 examples/fsdp_sharded.py --workspace runs/fsdp --steps 200
    torchrun --nproc-per-node 2 examples/fsdp_sharded.py --workspace runs/fsdp --steps 300  # resumes
    python examples/fsdp_sharded.py --workspace runs/fsdp --steps 400    # one process: DCP reshards
    torchrun --nproc-per-node 2 examples/fsdp_sharded.py --async-save   # saves in the background

With FSDP's default ``state_dict_options`` the model and optimizer state are split over the ranks,
so ``CheckpointingHook`` (``sharded="auto"``, the default) writes a sharded checkpoint: each rank
writes its shards with ``torch.distributed.checkpoint`` into ``checkpoints/<step>/sharded/``, rank 0
adds ``training_state.pt`` and, once every rank's files are durable, ``manifest.json``::

    checkpoints/200/  manifest.json  training_state.pt  sharded/.metadata  sharded/__0_0.distcp  sharded/__1_0.distcp

Nothing is gathered on one rank, in memory or on disk. All ranks must see the same filesystem (the
same path on every node). ``trainfsm inspect runs/fsdp`` verifies it and lists its keys and shapes.
The data, optimizer and forward are ``examples/ddp.py``'s (imported): only the model's wrapping
and the checkpoint hook differ.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from typing import Any

import torch
from ddp import DDPTrainer, arguments  # examples/ddp.py: this directory is on sys.path when a script here runs
from torch import nn

from trainfsm import CheckpointingHook
from trainfsm.distributed import DistEnv, cleanup_distributed, init_distributed, wrap_model


class FSDPTrainer(DDPTrainer):
    """``examples/ddp.py``'s trainer (data, optimizer, forward); only the wrapping and the hook differ."""

    def __init__(self, layout: DistEnv | None, interval: int, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(layout, interval, step_seconds=0.0, **kwargs)
        self.async_save = async_save

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(self.device)
        if self.layout is None:
            return model
        for layer in model:  # each Linear its own FSDP unit, then the root
            if isinstance(layer, nn.Linear):
                wrap_model(layer, "fsdp")
        return wrap_model(model, "fsdp")

    def build_hooks(self) -> list[Any]:
        # sharded="auto": sharded checkpoints for the split FSDP state, a full one in one process.
        # async_save: each rank writes its shards on a background thread while training goes on.
        return [CheckpointingHook(interval=self.interval, keep_previous=1, async_save=self.async_save)]


def main() -> None:
    parser = arguments(__doc__, "runs/fsdp")
    parser.add_argument("--async-save", action="store_true", help="write each checkpoint in the background")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    layout = init_distributed(timeout=timedelta(seconds=args.timeout))  # None outside torchrun/srun
    device = torch.device("cuda", layout.local_rank if layout else 0) if torch.cuda.is_available() else None
    trainer = FSDPTrainer(
        layout, args.interval, args.async_save, max_steps=args.steps, workspace=args.workspace, device=device
    )
    try:
        trainer.train()
        if layout is not None:
            torch.distributed.barrier()  # leave together: gloo may abort a rank whose peer tore down first
    finally:
        outcome = f"rank {layout.rank if layout else 0}: {trainer.exit_reason} at step {trainer.step}"
        del trainer  # the model holds the process group: see cleanup_distributed
        cleanup_distributed()
    print(outcome, file=sys.stderr)


if __name__ == "__main__":
    main()
