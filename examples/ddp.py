"""Data-parallel training with DDP: you set up the process group and wrap the model, trainfsm runs the loop.

    torchrun --nproc-per-node 2 examples/ddp.py --workspace runs/ddp --steps 200
    srun -n 2 python examples/ddp.py --workspace runs/ddp --steps 200   # inside an sbatch job
    python examples/ddp.py --workspace runs/ddp                          # one process, no DDP

``init_distributed()`` reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) or SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is MASTER_ADDR or
the job's first node, the port MASTER_PORT or 29500). Every rank writes its audit trail to
``WORKSPACE/logs/events.rank{R}.jsonl``; rank 0 writes the checkpoints, and running the same
command again resumes every rank from the latest complete one.

``--timeout`` is the process group's: a rank whose peer died or hangs in a collective fails after
at most that long instead of waiting forever (gloo notices a peer that exited at once).

``--loss-none-agreement`` passes ``loss_none_agreement=True``: the ranks then agree before every
backward, so a ``forward`` that returns None on one rank makes every rank skip that micro-batch (one
small all-reduce per micro-batch; see docs/guides/distributed.md). This example's forward
never returns None; the flag shows where the option goes.

``--loader stateful`` uses torchdata's ``StatefulDataLoader`` (``pip install 'trainfsm[data]'``),
which saves its own position; ``--workers N`` loads with N worker processes. With the default
``DataLoader`` a resume skips the used indices at the sampler (``num_workers=0``) or replays the
used batches (workers): see docs/guides/data-resume.md.

``--step-seconds S`` sleeps S seconds in every forward: slow steps to signal, freeze
(``kill -STOP``) or kill a rank by hand, as docs/guides/audit-trail.md does to show a hang.

``--stall-timeout`` and ``--stall-action`` set the stall watchdog (``stall_timeout``,
``stall_action``): a rank that makes no transition for longer than its budget writes a ``stall``
event naming where it is and what it waits in (a frozen peer leaves the others waiting in a
collective). ``--stall-timeout`` is ``auto`` (default: budgets learned from the run), ``none`` (no
watchdog) or seconds; ``--stall-action exit`` also ends the process with status 75 (exit reason
``stalled``, after a requeue on SLURM), so ``torchrun --max-restarts`` or the requeued job resumes
from the newest checkpoint: see docs/guides/audit-trail.md, "When a run hangs". Under ``auto`` a
step's budget is at least 2 minutes, longer than the default ``--timeout``: raise ``--timeout``
above the budget (or give a smaller ``--stall-timeout``), or a hung collective fails at
``--timeout`` before the watchdog reports it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainfsm import BaseTrainer, CheckpointingHook
from trainfsm.distributed import DistEnv, cleanup_distributed, init_distributed, wrap_model

log = logging.getLogger("examples.ddp")


def make_dataset(n: int = 1024, features: int = 32, classes: int = 4) -> TensorDataset:
    """Inputs labelled by a fixed random linear teacher: made here, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    return TensorDataset(x, (x @ torch.randn(features, classes, generator=generator)).argmax(1))


class DDPTrainer(BaseTrainer):
    def __init__(
        self,
        layout: DistEnv | None,
        interval: int,
        step_seconds: float,
        loader: str = "dataloader",
        workers: int = 0,
        hidden: tuple[int, int] = (64, 1),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.hidden = hidden
        self.layout = layout
        self.interval = interval
        self.step_seconds = step_seconds
        self.loader = loader
        self.workers = workers

    def build_data_loader(self) -> DataLoader[Any]:
        dataset = make_dataset()
        loader_type = DataLoader
        if self.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader  # trainfsm[data]

            loader_type = StatefulDataLoader
        # Each rank draws its own part of every epoch (one process: all of it); the trainer calls
        # sampler.set_epoch(epoch). The order depends on the seed and epoch alone, so a run resumed
        # on another number of ranks goes on where it stood, each sample once.
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, seed=0)
        return loader_type(dataset, batch_size=32, sampler=sampler, num_workers=self.workers)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        width, depth = self.hidden
        layers: list[nn.Module] = [nn.Linear(32, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 4)).to(self.device)
        return wrap_model(model, "ddp" if self.layout is not None else "none", self.device)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        # Every rank takes part in a save (gathers its RNG and data position); rank 0 writes. By
        # default SIGTERM and SIGUSR1 (what schedulers and torchrun send) checkpoint and exit.
        return [CheckpointingHook(interval=self.interval, keep_previous=1)]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.step_seconds:
            time.sleep(self.step_seconds)  # stands in for real work, to make room for a kill
        x, y = (t.to(self.device) for t in input)
        logits = self.model(x)  # type: ignore[misc]
        return nn.functional.cross_entropy(logits, y), {"accuracy": (logits.argmax(1) == y).float().mean()}


def arguments(description: str | None, workspace: str) -> argparse.ArgumentParser:
    """The options every distributed example here takes (``examples/fsdp_sharded.py`` too)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", type=Path, default=Path(workspace))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--interval", type=int, default=50, help="checkpoint every this many steps")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    return parser


def stall_timeout(text: str) -> float | str | None:
    """``--stall-timeout``: ``auto``, ``none`` (no watchdog) or a positive number of seconds."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else "auto"
    try:
        seconds = float(word)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a positive number of seconds, got {text!r}")
    return seconds


def main() -> None:
    parser = arguments(__doc__, "runs/ddp")
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="sleep this long in every forward (default 0): slow steps that leave time to signal, freeze "
        "(kill -STOP) or kill a rank by hand, e.g. to reproduce a hang or a preemption",
    )
    parser.add_argument(
        "--loss-none-agreement", action="store_true", help="ranks agree on loss=None before every backward"
    )
    parser.add_argument(
        "--loader", choices=("dataloader", "stateful"), default="dataloader", help="stateful: torchdata's"
    )
    parser.add_argument("--workers", type=int, default=0, help="data loader worker processes per rank")
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step over all ranks, kept when the run resumes on another number of ranks "
        "(accumulation = it / (ranks x 32)); default: one batch of 32 per rank",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        nargs=2,
        default=(64, 1),
        metavar=("WIDTH", "LAYERS"),
        help="hidden layers of the model (default 64 1); 768 3 makes 4.8 MB of parameters in two DDP buckets",
    )
    parser.add_argument(
        "--stall-timeout",
        type=stall_timeout,
        default="auto",
        help="stall watchdog budget: auto (learned from the run), none (no watchdog) or seconds",
    )
    parser.add_argument(
        "--stall-action",
        choices=("record", "exit"),
        default="record",
        help="on a stall: record it and keep waiting, or record it and exit 75 (requeued on SLURM)",
    )
    parser.add_argument(
        "--max-oom-retries",
        type=int,
        default=0,
        help="halve the micro-batches up to this many times when a step runs out of device memory (0: fail)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    layout = init_distributed(timeout=timedelta(seconds=args.timeout))  # None outside torchrun/srun
    rank = layout.rank if layout is not None else 0
    device = torch.device("cuda", layout.local_rank if layout else 0) if torch.cuda.is_available() else None
    trainer = DDPTrainer(
        layout,
        args.interval,
        args.step_seconds,
        args.loader,
        args.workers,
        tuple(args.hidden),
        max_steps=args.steps,
        global_batch_size=args.global_batch_size,
        workspace=args.workspace,
        device=device,
        loss_none_agreement=args.loss_none_agreement,
        stall_timeout=args.stall_timeout,
        stall_action=args.stall_action,
        max_oom_retries=args.max_oom_retries,
    )
    try:
        trainer.train()  # on SIGTERM/SIGUSR1: checkpoint at a step every rank agrees on, exit 143/138
        if layout is not None:
            torch.distributed.barrier()  # leave together: gloo may abort a rank whose peer tore down first
    except Exception as exc:
        if layout is not None:
            # A rank's own error, or a collective that failed because a peer failed, died or hung
            # (after --timeout). Every rank stops; the command resumes all of them from the last
            # complete checkpoint.
            log.error(
                "rank %d of %d failed at step %d (%s: %s). If another rank failed first, its error "
                "(in its output and %s) is the cause. Run the same command again on every rank to "
                "resume from the last complete checkpoint.",
                rank,
                layout.world_size,
                trainer.step,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
                args.workspace / "logs" / "events.rank*.jsonl",
            )
        raise
    finally:
        outcome = f"rank {rank}: {trainer.exit_reason} at step {trainer.step}"
        if rank == 0 and trainer.exit_reason == "completed":
            weights = {k: v.detach().cpu() for k, v in trainer.unwrapped_model.state_dict().items()}
            torch.save(weights, args.workspace / "final.pt")
        # The DDP model holds the process group: drop it first, so that destroying the group really
        # ends gloo's threads now, not during interpreter shutdown, where they may abort the process.
        del trainer
        cleanup_distributed()
    print(outcome, file=sys.stderr)


if __name__ == "__main__":
    main()
