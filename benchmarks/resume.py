"""Time from launch to the first resumed step, by data position and loader (issue 15).

For each loader and each position (batches already used in the epoch), a checkpoint at that
position is made, then a new process is launched that resumes from it and trains one step; the
time from the launch to the end of that step is measured (what a preempted job waits for after
every requeue). Rows, side by side in one run, positions interleaved:

- map-style ``DataLoader``, ``data_resume="skip"`` (before: every used batch is loaded again);
- map-style ``DataLoader``, ``data_resume="auto"`` (now ``"sampler"``: indices skipped, nothing loaded);
- torchdata's ``StatefulDataLoader`` (``"state"``), when torchdata is installed (``trainfsm[data]``);
- an iterable-style dataset (``"skip"``: nothing else can know its position).

The dataset's ``__getitem__`` costs ``--sample-us`` (50 us) of busy CPU, batch 16, shuffled. Target:
the map-style ``"auto"`` and stateful rows flat: the deepest position <= 1.2x position 0.

How a checkpoint at a deep position is made without training that many steps: one step is
trained and saved by the real trainer; its training state then gets the step and the data
position (for ``StatefulDataLoader``, the state of a twin loader over a free dataset iterated that
far), and is saved again through ``CheckpointStore`` (manifest, checksums).

    python benchmarks/resume.py            # positions 0, 1k, 10k, 100k
    python benchmarks/resume.py --quick    # positions 0 and 200, for CI smoke runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.checkpoint.store import CheckpointStore

BATCH = 16
KINDS = ("map, skip (before)", "map, auto (sampler)", "StatefulDataLoader", "iterable, skip")


class Costly(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` samples whose loading costs ``cost`` seconds of CPU each (decoding, augmentation)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return torch.full((4,), float(index % 7)), torch.ones(1)


class CostlyStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, cost: float) -> None:
        self.samples = Costly(n, cost)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.samples[i] for i in range(len(self.samples)))


def loader_of(kind: str, samples: int, cost: float) -> Any:
    if kind == "iterable, skip":
        return DataLoader(CostlyStream(samples, cost), batch_size=BATCH)
    if kind == "StatefulDataLoader":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Costly(samples, cost), batch_size=BATCH, shuffle=True)
    return DataLoader(Costly(samples, cost), batch_size=BATCH, shuffle=True)


class FirstStep(BaseHook):
    def on_after_step(self, trainer: BaseTrainer) -> None:
        print(json.dumps({"first_step_done": time.time()}), flush=True)


class Trainer(BaseTrainer):
    def __init__(self, kind: str, samples: int, cost: float, report: bool = False, **kwargs: Any) -> None:
        super().__init__(device="cpu", **kwargs)
        self.kind, self.samples, self.cost, self.report = kind, samples, cost, report

    def build_data_loader(self) -> Any:
        return loader_of(self.kind, self.samples, self.cost)

    def build_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.01)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        mode = "skip" if self.kind.endswith("(before)") else "auto"
        hooks: list[Any] = [CheckpointingHook(interval=10**9, data_resume=mode, exit_signals=[])]
        return [*hooks, FirstStep()] if self.report else hooks

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]


def child(workspace: Path, kind: str, samples: int, cost: float, steps: int) -> None:
    Trainer(kind, samples, cost, report=True, max_steps=steps, workspace=workspace).train()


def checkpoint_at(workspace: Path, kind: str, samples: int, position: int) -> None:
    """A checkpoint of ``kind``'s trainer at step ``position``, that many batches into epoch 0."""
    shutil.rmtree(workspace, ignore_errors=True)
    Trainer(kind, samples, 0.0, max_steps=1, workspace=workspace).train()
    root = workspace / "checkpoints"
    store = CheckpointStore(root)
    parts = CheckpointStore.load(root / "1")
    training = parts["training_state"]
    training["step"] = position
    data = training["ranks"][0]["data"]
    data["batches"] = position
    if kind == "StatefulDataLoader":  # the loader's own state that far: a twin over a free dataset
        twin = loader_of(kind, samples, 0.0)
        iterator = iter(twin)
        for _ in range(position):
            next(iterator)
        data["loader"] = twin.state_dict()
    store.save(position, parts, keep=False)
    store.close()
    if position != 1:
        shutil.rmtree(root / "1")


def launch(workspace: Path, kind: str, samples: int, cost: float, position: int) -> float:
    """Seconds from launching a resuming process to the end of its first step."""
    out = workspace / "child.out"
    started = time.time()
    with open(out, "w") as sink:
        code = subprocess.call(
            [sys.executable, __file__, "--child", str(workspace), kind, str(samples), str(cost), str(position + 1)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.startswith('{"first_step_done"')]
    if code != 0 or len(lines) != 1:
        raise RuntimeError(f"{kind} at {position}: exit {code}\n{out.read_text()[-3000:]}")
    return float(lines[0]["first_step_done"]) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[0, 1000, 10_000, 100_000])
    parser.add_argument("--sample-us", type=float, default=50.0, help="CPU cost of one __getitem__")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="rows to measure")
    parser.add_argument("--quick", action="store_true", help="positions 0 and 200: a smoke run (no verdict)")
    parser.add_argument("--child", nargs=5, metavar=("WORKSPACE", "KIND", "SAMPLES", "COST", "STEPS"))
    args = parser.parse_args()
    if args.child:
        workspace, kind, samples, cost, steps = args.child
        child(Path(workspace), kind, int(samples), float(cost), int(steps))
        return
    if args.quick:
        args.positions = [0, 200]
    torch.set_num_threads(1)
    kinds = list(args.kinds)
    try:
        import torchdata  # noqa: F401
    except ImportError:
        if "StatefulDataLoader" in kinds:
            kinds.remove("StatefulDataLoader")
        print("torchdata is not installed (pip install 'trainfsm[data]'): no StatefulDataLoader row")
    samples = (max(args.positions) + 2) * BATCH
    cost = args.sample_us * 1e-6
    seconds: dict[str, dict[int, float]] = {kind: {} for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for position in args.positions:  # interleaved: every loader at one position, then the next
            for kind in kinds:
                workspace = Path(tmp) / "run"
                checkpoint_at(workspace, kind, samples, position)
                seconds[kind][position] = launch(workspace, kind, samples, cost, position)
    header = " | ".join(f"{p:>9,}" for p in args.positions)
    print(f"| loader, mode | {header} | deepest / 0 |")
    print(f"|---|{'---:|' * len(args.positions)}---:|")
    for kind in kinds:
        row = seconds[kind]
        ratio = row[args.positions[-1]] / row[args.positions[0]]
        print(f"| {kind} | {' | '.join(f'{row[p]:7.2f} s' for p in args.positions)} | {ratio:5.2f} |")
    if args.quick:
        print("quick smoke run: positions 0 and 200; no verdict")
        return
    flat = [k for k in ("map, auto (sampler)", "StatefulDataLoader") if k in seconds]
    verdict = all(seconds[k][args.positions[-1]] <= 1.2 * seconds[k][args.positions[0]] for k in flat)
    print(f"target: {', '.join(flat)} at {args.positions[-1]:,} <= 1.2x position 0: {'met' if verdict else 'MISSED'}")


if __name__ == "__main__":
    main()
