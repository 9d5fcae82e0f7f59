"""Per-step cost of BaseTrainer over a hand-written DDP loop doing the same work, on 2 gloo ranks.

Each rank (a process, one thread) runs both, interleaved step by step: the
trainer's data iterator is a generator that, before handing the trainer its next batch, runs one
step of the hand-written loop and times it; the trainer's step time is the time from handing over
a batch to the next request. Both loops wrap their own copy of the model in
DistributedDataParallel on the same process group, see the same batches and use Adam, so every
rank issues the same collectives in the same order, and noise from the shared machine (and from
waiting for the other rank) hits both sides alike. The trainer runs with its audit trail on (a
workspace) and its default non-finite guard, which the hand-written loop does not have.

    python benchmarks/ddp_overhead.py            # both cases, both ranks
    python benchmarks/ddp_overhead.py --quick    # fewer steps, a smoke run (no verdict)

Target (issue 7): ratio <= 1.05, on the total time of the timed steps (what a run waits for); the
median step of each is printed beside it (a median hides every periodic cost).
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
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn

TARGET = 1.05
CASES = {"small": (128, 32), "wide": (2048, 256)}  # name: (hidden width, batch per rank)


def interleaved(
    hand_step: Callable[[int], None],
    data: list[Any],
    steps: int,
    warmup: int,
    hand: list[float],
    trainer_times: list[float],
) -> Iterator[Any]:
    """The trainer's data: before each batch, one timed hand-written step. The trainer's own step
    is the time between two requests for a batch: the hand step runs outside that interval."""
    resumed = None
    for i in range(steps + warmup + 1):
        now = time.perf_counter()
        if resumed is not None and i > warmup:
            trainer_times.append(now - resumed)
        start = time.perf_counter()
        hand_step(i)
        if i >= warmup:
            hand.append(time.perf_counter() - start)
        resumed = time.perf_counter()
        yield data[i % len(data)]


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, 10))


def run_case(rank: int, width: int, batch: int, steps: int, warmup: int) -> dict[str, float]:
    """One case on this rank: the total and the median of the hand-written and the trainer's steps,
    in seconds (the first ``warmup`` steps of each untimed)."""
    from torch.nn.parallel import DistributedDataParallel

    from trainfsm import BaseTrainer

    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as in DDP
    data = [
        (torch.randn(batch, 784, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
        for _ in range(16)
    ]
    model = DistributedDataParallel(make_model(width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def hand_step(i: int) -> None:
        x, y = data[i % 16]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    hand: list[float] = []
    trainer_times: list[float] = []
    batches = interleaved(hand_step, data, steps, warmup, hand, trainer_times)

    class BenchTrainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            return batches

        def build_model(self) -> nn.Module:
            return DistributedDataParallel(make_model(width))

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            x, y = input
            return nn.functional.cross_entropy(self.model(x), y), {}  # type: ignore[misc]

    with tempfile.TemporaryDirectory() as workspace:
        BenchTrainer(max_steps=steps + warmup, workspace=workspace, device="cpu").train()
    return {
        "hand": statistics.median(hand),
        "trainer": statistics.median(trainer_times),
        "hand_total": sum(hand),
        "trainer_total": sum(trainer_times),
    }


def child(rank: int, port: int, quick: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=60)
    )
    try:
        steps = {"small": (200, 20), "wide": (10, 3)} if quick else {"small": (3000, 100), "wide": (300, 10)}
        for name, (width, batch) in CASES.items():
            result = run_case(rank, width, batch, *steps[name])
            print(json.dumps({"case": name, "rank": rank, "steps": steps[name][0], **result}), flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run, not a measurement")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        child(args.rank, args.port, args.quick)
        return

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--port", str(port), *(["--quick"] if args.quick else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([*argv, "--rank", str(rank)], env=env, stdout=subprocess.PIPE, text=True) for rank in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=1200)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode != 0 for proc in procs):
        sys.exit(f"a rank failed: exit codes {[proc.returncode for proc in procs]}")
    results = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]
    ratios = []
    for name, (width, batch) in CASES.items():
        for r in sorted((r for r in results if r["case"] == name), key=lambda r: r["rank"]):
            ratio = r["trainer_total"] / r["hand_total"]
            ratios.append(ratio)
            print(
                f"{name:<6} MLP 784-{width}-10 batch {batch}/rank  rank {r['rank']}  steps {r['steps']:<5} "
                f"total: hand DDP {r['hand_total']:7.3f} s  trainfsm {r['trainer_total']:7.3f} s  ratio {ratio:.3f}   "
                f"(median step: {r['hand'] * 1e6:8.1f} / {r['trainer'] * 1e6:8.1f} us, "
                f"ratio {r['trainer'] / r['hand']:.3f})"
            )
    if args.quick:
        print("quick run: too few steps for a verdict")
    else:
        worst = max(ratios)
        verdict = "met" if worst <= TARGET else "MISSED"
        print(f"target: total-time ratio <= {TARGET} on every rank and case ({verdict}, worst {worst:.3f})")


if __name__ == "__main__":
    main()
