"""Sharded checkpoint saves on 2 gloo ranks (FSDP2 ``fully_shard``), side by side in one run.

The same trainer (one square linear layer of ``--megabytes`` split over the ranks, Adam: the
optimizer FSDP runs usually have, so the state is 3x the model) saves a sharded checkpoint after
every step, first synchronously, then with ``async_save=True``. Printed:
the median synchronous save (every rank writes its shards with DCP, rank 0 the manifest), and the
median time the training loop is blocked by an asynchronous one (staging the non-parameter state,
the collective that agrees on the directory, and the wait for the parameter copies before the next
optimizer step). Target, as for a full checkpoint: blocked <= 10% of the synchronous save.

``--optimizer sgd`` (no momentum: an optimizer without state) checks that such an optimizer costs
nothing more: torch's ``get_state_dict`` would make zero gradients and run a zero-rate optimizer
step at every save, which ``trainer.state_dict()`` no longer lets it do (issue 35).

    python benchmarks/sharded_checkpoint.py                # 200 MB over 2 ranks, 7 saves each
    python benchmarks/sharded_checkpoint.py --quick        # 16 MB, 2 saves: a smoke run, no verdict
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint import BigTrainer  # benchmarks/checkpoint.py: this directory is on sys.path when a script here runs
from torch import nn

from trainfsm import CheckpointingHook
from trainfsm.distributed import wrap_model

MB = 1 << 20
WORLD = 2


class ShardedTrainer(BigTrainer):
    """``checkpoint.py``'s trainer (one square linear layer of ``width``), ``fully_shard``-ed over the
    ranks, with Adam or SGD."""

    def __init__(self, width: int, batch: int, optimizer: str, hook: CheckpointingHook, **kwargs: Any) -> None:
        super().__init__(width, batch, [hook], **kwargs)
        self.optimizer_name = optimizer

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return wrap_model(super().build_model(), "fsdp")

    def build_optimizer(self) -> torch.optim.Optimizer:
        make = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.SGD
        return make(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]


def rank_main(rank: int, port: int, directory: Path, megabytes: int, saves: int, batch: int, optimizer: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    width = int((megabytes * MB / 4) ** 0.5)
    results: dict[str, float] = {}
    for mode in ("sync", "async"):
        workspace = directory / mode
        hook = CheckpointingHook(interval=1, async_save=mode == "async")
        trainer = ShardedTrainer(width, batch, optimizer, hook, max_steps=saves + 1, workspace=workspace, device="cpu")
        trainer.train()
        assert hook.saves_sharded, "the FSDP state was not saved sharded"
        del trainer, hook  # the FSDP model holds the group: free it before the group goes
        if rank == 0:
            lines = (workspace / "logs" / "events.rank0.jsonl").read_text().splitlines()
            saved = [e for e in map(json.loads, lines) if e["event"] == "checkpoint_saved"][1:]  # first: warm-up
            key = "blocked_seconds" if mode == "async" else "seconds"
            results[mode] = statistics.median(e[key] for e in saved)
    if rank == 0:
        (directory / "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=200, help="the model's size, split over 2 ranks")
    parser.add_argument("--saves", type=int, default=7, help="saves of each kind (medians are compared)")
    parser.add_argument("--batch", type=int, default=8, help="sets how much compute the parameter copies overlap")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="sgd: no optimizer state")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="16 MB, 2 saves: a smoke run (no verdict)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.megabytes, args.saves = 16, 2
    if args.rank is not None:
        rank_main(args.rank, args.port, args.dir, args.megabytes, args.saves, args.batch, args.optimizer)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        command = [sys.executable, __file__, "--dir", tmp, "--port", str(port), "--megabytes", str(args.megabytes)]
        command += ["--saves", str(args.saves), "--batch", str(args.batch), "--optimizer", args.optimizer]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "src"]))}
        ranks = [subprocess.Popen([*command, "--rank", str(rank)], env=env) for rank in range(WORLD)]
        codes = [rank.wait(timeout=600) for rank in ranks]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        results = json.loads((Path(tmp) / "results.json").read_text())
    share = results["async"] / results["sync"]
    print(
        f"| {args.megabytes:>5} MB model ({args.optimizer}) over {WORLD} ranks | sharded sync save "
        f"{results['sync']:7.3f} s | async: loop blocked {results['async']:7.3f} s | {share:6.1%} |"
    )
    if args.quick:
        print("quick smoke run: 16 MB and 2 saves; no verdict")
        return
    print(f"target: async blocked <= 10% of the sync save ({'met' if share <= 0.10 else 'MISSED'})")


if __name__ == "__main__":
    main()
