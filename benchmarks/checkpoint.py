"""Checkpoint save cost, side by side in one process.

1. A synchronous ``CheckpointStore.save`` (fsyncs, xxh3 checksums, manifest, rename, ``latest``)
   against the two durable references, alternating round by round so that all see the same
   machine: "disk alone" (the same bytes written from one buffer and fsynced, nothing else to do:
   the physical floor, no save can be faster) and ``torch.save`` + fsync (the naive durable save).
   The disk alone is timed two ways, with ``O_DIRECT`` and through the page cache with each 4 MiB's
   writeback started at once; which is faster depends on the storage, and the floor is the faster
   median of the two. Targets, on the median over ``--rounds``: save <= 1.15 x disk alone and
   <= 1.0 x ``torch.save`` + fsync. Printed beside it: fastest vs fastest, the total over all
   rounds, and, as information only, the ratio to a plain ``torch.save``, which only fills the
   page cache and is not durable.
2. With ``CheckpointingHook(async_save=True)`` in a real trainer, the time the training loop is
   blocked per save against the synchronous save of the same trainer. Target: <= 10 % of it.
   Parameters and optimizer state are copied on the writer thread while the next step's forward
   and backward run, so what blocks depends on a step's compute: ``--batch`` sets it, and the
   table prints it.

    python benchmarks/checkpoint.py                  # ~200 MB and ~1 GB
    python benchmarks/checkpoint.py --quick          # a smoke run: 16 MB, 2 rounds, no verdict
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.checkpoint.store import CheckpointStore

MB = 1 << 20
SAVE_TARGETS = {"disk": 1.15, "fsync": 1.0}  # CheckpointStore.save's median over each one's median


def state_of(megabytes: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    chunk = 4 * MB // 4  # 4 MB float32 tensors, like a model's layers
    return {f"layer{i}.weight": torch.randn(chunk, generator=generator) for i in range(megabytes // 4)}


def _durable_torch_save(state: dict[str, torch.Tensor], target: Path) -> None:
    with open(target, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _disk_alone(block: memoryview, nbytes: int, target: Path, direct: bool) -> None:
    """Write ``nbytes`` to ``target`` as fast as this disk takes them durably, with no other work:
    ``block`` (page-aligned) over and over, one write at a time (two in flight were ~10% slower
    here), then fsync. ``direct``: with ``O_DIRECT`` (through the page cache where it is refused);
    otherwise through the page cache, each block's writeback started as soon as it is written.
    No synchronous save of that many bytes can take less than the faster of the two."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = -1
    if direct:
        try:
            fd = os.open(target, flags | getattr(os, "O_DIRECT", 0))
        except OSError:
            direct = False
    if fd < 0:
        fd = os.open(target, flags)
    try:
        for offset in range(0, nbytes, block.nbytes):
            os.pwrite(fd, block, offset)
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, block.nbytes, os.POSIX_FADV_DONTNEED)
        os.fsync(fd)
    finally:
        os.close(fd)


def compare_sync(directory: Path, megabytes: int, rounds: int) -> dict[str, float]:
    """Median seconds of each, rounds alternating; returns CheckpointStore.save's median over each
    reference's median ("disk": the faster of the two disk-alone ways, "fsync").

    Each round runs the five in a different order (rotated), so no kind always follows the same
    one. Before each (untimed) the previous files are deleted and ``os.sync()`` settles the disk:
    otherwise a save pays for the journal commit of the deletion just before it, which in a
    training run happens long before the next save.
    """
    state = state_of(megabytes)
    store = CheckpointStore(directory / "store")
    store.prepare()  # what CheckpointingHook does in RESTORE
    target = directory / "plain.pt"
    nbytes = sum(t.nbytes for t in state.values())
    aligned = mmap.mmap(-1, 4 * MB)
    aligned.write(os.urandom(4 * MB))
    block = memoryview(aligned)
    kinds = {
        "plain": lambda step: torch.save(state, target),
        "direct": lambda step: _disk_alone(block, nbytes, target, direct=True),
        "cached": lambda step: _disk_alone(block, nbytes, target, direct=False),
        "fsync": lambda step: _durable_torch_save(state, target),
        "ours": lambda step: store.save(step, {"model": state}, keep=False),
    }
    names = list(kinds)
    times: dict[str, list[float]] = {key: [] for key in names}
    for step in range(rounds):
        for key in names[step % len(names) :] + names[: step % len(names)]:
            target.unlink(missing_ok=True)
            store.prune(keep_previous=0)
            os.sync()  # untimed: each save starts on a settled disk, not behind the last one's deletion
            start = time.perf_counter()
            kinds[key](step)
            times[key].append(time.perf_counter() - start)
    target.unlink(missing_ok=True)
    store.close()
    median = {key: statistics.median(times[key]) for key in names}
    floor = "direct" if median["direct"] <= median["cached"] else "cached"
    median["disk"], times["disk"] = median[floor], times[floor]
    ratios = {ref: median["ours"] / median[ref] for ref in SAVE_TARGETS}
    fastest = {ref: min(times["ours"]) / min(times[ref]) for ref in SAVE_TARGETS}
    totals = {ref: sum(times["ours"]) / sum(times[ref]) for ref in SAVE_TARGETS}
    print(
        f"| {megabytes:>5} MB | sync save, median of {rounds} | disk alone {median['disk']:6.3f} s (O_DIRECT "
        f"{median['direct']:6.3f} s, page cache {median['cached']:6.3f} s) | torch.save+fsync "
        f"{median['fsync']:6.3f} s | CheckpointStore.save {median['ours']:6.3f} s | vs disk alone "
        f"{ratios['disk']:4.2f} (fastest {fastest['disk']:4.2f}, totals {totals['disk']:4.2f}) | vs torch.save+fsync "
        f"{ratios['fsync']:4.2f} (fastest {fastest['fsync']:4.2f}, totals {totals['fsync']:4.2f}) | plain torch.save "
        f"{median['plain']:6.3f} s, not durable: ratio {median['ours'] / median['plain']:4.2f} |"
    )
    return ratios


class StepTimes(BaseHook):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_after_step(self, trainer: BaseTrainer) -> None:
        self.times.append(trainer.step_info["step_time"])


class BigTrainer(BaseTrainer):
    """One square linear layer of ``width`` and SGD: the state is the model's weight."""

    def __init__(self, width: int, batch: int, hook: CheckpointingHook, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.width, self.batch, self.hook, self.timer = width, batch, hook, StepTimes()

    def build_data_loader(self) -> Any:
        return [torch.randn(self.batch, self.width)]

    def build_model(self) -> nn.Module:
        return nn.Linear(self.width, self.width, bias=False)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        return [self.hook, self.timer]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.model(input).square().mean(), {}  # type: ignore[misc]


def compare_async(directory: Path, megabytes: int, steps: int, batch: int) -> float:
    width = int((megabytes * MB / 4) ** 0.5)
    results = {}
    step_time = 0.0
    for mode in ("sync", "async"):
        workspace = directory / mode
        hook = CheckpointingHook(interval=1, async_save=mode == "async")
        trainer = BigTrainer(width, batch, hook, max_steps=steps, workspace=workspace, device="cpu")
        trainer.train()
        step_time = statistics.median(trainer.timer.times)
        lines = (workspace / "logs" / "events.rank0.jsonl").read_text().splitlines()
        saved = [e for e in map(json.loads, lines) if e["event"] == "checkpoint_saved"]
        key = "blocked_seconds" if mode == "async" else "seconds"
        results[mode] = statistics.median(e[key] for e in saved)
        shutil.rmtree(workspace)
    share = results["async"] / results["sync"]
    print(
        f"| {megabytes:>5} MB | async save | sync save {results['sync']:7.3f} s | loop blocked "
        f"{results['async']:7.3f} s | {share:6.1%} | (batch {batch}: a step's compute {step_time:.3f} s) |"
    )
    return share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 1024], help="state sizes in MB")
    parser.add_argument("--rounds", type=int, default=8, help="saves of each kind per size (medians are compared)")
    parser.add_argument(
        "--batch", type=int, default=8, help="batch of the async case: sets how much compute the copy overlaps"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on /work or /tmp)")
    parser.add_argument("--quick", action="store_true", help="16 MB, 2 rounds: a smoke run (no verdict)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.rounds = [16], 2
    torch.set_num_threads(1)
    base = args.dir or Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        directory = Path(tmp)
        ratios: list[dict[str, float]] = []
        shares = []
        for megabytes in args.sizes:
            ratios.append(compare_sync(directory, megabytes, args.rounds))
            shares.append(compare_async(directory, megabytes, steps=args.rounds + 1, batch=args.batch))
    if args.quick:
        print("quick smoke run: 16 MB, where fixed costs (several fsyncs) dominate, and 2 rounds; no verdict")
        return
    verdicts = [
        f"sync save <= {SAVE_TARGETS[ref]} x {label} "
        f"({'met' if max(r[ref] for r in ratios) <= SAVE_TARGETS[ref] else 'MISSED'}: "
        f"{', '.join(f'{r[ref]:.2f}' for r in ratios)})"
        for ref, label in (("disk", "disk alone"), ("fsync", "torch.save+fsync"))
    ]
    share_verdict = "met" if max(shares) <= 0.10 else "MISSED"
    print(f"targets: {'; '.join(verdicts)}; async blocked <= 10% ({share_verdict})")


if __name__ == "__main__":
    main()
