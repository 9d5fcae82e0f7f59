"""What a SIGKILL costs the audit trail: kill training at a random moment, compare the trail's last
record with where the process really was.

Each trial is a real process (forked from this one after torch is imported, so a trial costs no
import) that trains with a sleep of ``--step-seconds`` in ``forward`` and no checkpoints (so only
the writer's own write-out bounds the loss, no decision event helps). ``forward`` first writes the
step in flight to a side file (the page cache keeps it through SIGKILL). After the kill the trail is
read back as ``trainfsm audit`` reads it and two lags are measured:

- steps: the step in flight, less one, less the last step the trail shows completed (<= 0: the
  trail is at most one step behind the step in flight);
- seconds: the kill's time less the trail's last record's time.

A trial passes when either is within bounds (``--max-steps-behind 0``, ``--max-seconds 1.0``).
With ``--ddp`` each trial is a 2-rank gloo DDP job and rank 1 is the one killed (rank 0 is then
killed too: its next all-reduce would wait for the dead rank until the timeout).

    python tests/faults/trail_lag.py --trials 20                 # 1 ms, 50 ms and 1 s steps
    python tests/faults/trail_lag.py --trials 20 --ddp --step-seconds 0.05
    python tests/faults/trail_lag.py --trials 3 --json           # what tests/test_trail_lag.py runs
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainfsm import BaseTrainer
from trainfsm.trail.reader import TrailError, read_events

HERE = Path(__file__).resolve()


class Forever:
    """An endless loader: no epoch ends, so no epoch event writes the trail for the writer."""

    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        self.batch = (torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))

    def __iter__(self) -> Any:
        return itertools.repeat(self.batch)


def child(workspace: Path, step_seconds: float, truth: Path, rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=60)
        )
    fd = os.open(truth, os.O_WRONLY | os.O_CREAT, 0o644)

    class Trainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            return Forever(rank)

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            return DistributedDataParallel(model) if world > 1 else model

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=0.01)  # type: ignore[union-attr]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            os.pwrite(fd, f"{self.step:>12}\n".encode(), 0)  # the step in flight, before its work
            time.sleep(step_seconds)
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    Trainer(max_steps=10**9, workspace=workspace, device="cpu").train()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fork(workspace: Path, step_seconds: float, truth: Path, rank: int, world: int, port: int) -> int:
    pid = os.fork()
    if pid == 0:  # the trial: never returns into the parent's code
        code = 0
        try:
            os.setpgid(0, 0)
            child(workspace, step_seconds, truth, rank, world, port)
        except BaseException:  # reported through the exit status
            code = 1
        os._exit(code)
    return pid


def _reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


class Trial:
    """One forked job, stepped by ``poll()`` so that several run at once without threads."""

    def __init__(self, root: Path, step_seconds: float, ddp: bool, rng: random.Random) -> None:
        self.step_seconds, self.ddp = step_seconds, ddp
        self.workspace = Path(tempfile.mkdtemp(dir=root))
        world = 2 if ddp else 1
        self.victim = world - 1
        self.truth = self.workspace / f"truth.rank{self.victim}"
        self.delay = rng.uniform(0.05, max(2.0, 3.5 * step_seconds))
        port = _free_port()
        self.pids = [
            _fork(self.workspace, step_seconds, self.workspace / f"truth.rank{r}", r, world, port) for r in range(world)
        ]
        self.launched = time.time()
        self.kill_at: float | None = None
        self.result: dict[str, Any] | None = None

    def poll(self) -> bool:
        """Advance; True once the result is in."""
        now = time.time()
        if self.kill_at is None:
            # Training has started once the first forward wrote its step.
            if self.truth.exists() and self.truth.stat().st_size:
                self.kill_at = now + self.delay
            elif now - self.launched > 120:
                self.abandon("training did not start within 120 s")
                return True
            return False
        if now < self.kill_at:
            return False
        killed_at = time.time()
        os.kill(self.pids[self.victim], signal.SIGKILL)
        os.waitpid(self.pids[self.victim], 0)
        for pid in self.pids[: self.victim]:
            _reap(pid)
        self.result = self.measure(killed_at)
        return True

    def abandon(self, why: str) -> None:
        for pid in self.pids:
            _reap(pid)
        self.result = {"step_seconds": self.step_seconds, "ddp": self.ddp, "ok": False, "error": why}

    def measure(self, killed_at: float) -> dict[str, Any]:
        in_flight = int(self.truth.read_text().strip() or 0)
        try:
            events = list(read_events(self.workspace, self.victim))
        except TrailError as exc:
            return {"step_seconds": self.step_seconds, "ddp": self.ddp, "ok": False, "error": str(exc)}
        done = [e["step"] for e in events if e["event"] == "transition" and e["trigger"] == "stepped"]
        last_done = done[-1] if done else 0
        return {
            "step_seconds": self.step_seconds,
            "ddp": self.ddp,
            "killed_after": round(self.delay, 3),
            "in_flight": in_flight,
            "last_done": last_done,
            "steps_behind": in_flight - 1 - last_done,
            "seconds_behind": round(killed_at - events[-1]["ts"], 3),
        }


def run_trials(root: Path, plan: list[float], ddp: bool, rng: random.Random, parallel: int) -> list[dict[str, Any]]:
    waiting, running, results = list(plan), [], []
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                running.append(Trial(root, waiting.pop(0), ddp, rng))
            for trial in [t for t in running if t.poll()]:
                running.remove(trial)
                results.append(trial.result)
            time.sleep(0.002)
    finally:
        for trial in running:  # interrupted: no trial outlives this process
            trial.abandon("interrupted")
    return results


def _warm_up() -> None:
    """Pay the one-off imports (building the first optimizer imports torch._dynamo: seconds) here,
    once, before forking: each trial then starts in milliseconds. No tensor work, so no threads."""
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    importlib.import_module("torch.distributed.checkpoint.state_dict")  # the trainer imports it lazily


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-seconds", type=float, nargs="+", default=[0.001, 0.05, 1.0])
    parser.add_argument("--trials", type=int, default=20, help="per step time")
    parser.add_argument("--ddp", action="store_true", help="2-rank gloo DDP, rank 1 killed")
    parser.add_argument("--max-steps-behind", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--parallel", type=int, default=4, help="trials at once (they mostly sleep)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    _warm_up()
    plan = [s for s in args.step_seconds for _ in range(args.trials)]
    rng.shuffle(plan)  # step times interleaved: all see the same machine
    with tempfile.TemporaryDirectory(prefix="trail-lag-") as root:
        results = run_trials(
            Path(root), plan, args.ddp, rng, args.parallel if not args.ddp else max(1, args.parallel // 2)
        )
    for result in results:
        result["ok"] = result.get("ok", True) and (
            result["steps_behind"] <= args.max_steps_behind or result["seconds_behind"] <= args.max_seconds
        )
        if not args.json:
            print(json.dumps(result), flush=True)
    summary = []
    for step_seconds in args.step_seconds:
        own = [r for r in results if r["step_seconds"] == step_seconds and "steps_behind" in r]
        summary.append(
            {
                "step_seconds": step_seconds,
                "trials": len([r for r in results if r["step_seconds"] == step_seconds]),
                "passed": len([r for r in results if r["step_seconds"] == step_seconds and r["ok"]]),
                "max_steps_behind": max((r["steps_behind"] for r in own), default=None),
                "max_seconds_behind": max((r["seconds_behind"] for r in own), default=None),
            }
        )
    failed = [r for r in results if not r["ok"]]
    if args.json:
        print(json.dumps({"ddp": args.ddp, "summary": summary, "failed": failed}))
    else:
        print("| step time | trials passed | max steps behind the step in flight | max seconds behind the kill |")
        print("|---|---|---|---|")
        for s in summary:
            print(
                f"| {s['step_seconds']} s | {s['passed']} of {s['trials']} | {s['max_steps_behind']} | "
                f"{s['max_seconds_behind']} |"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
