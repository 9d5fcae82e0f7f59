"""Kill a real training process with SIGKILL at random moments and restart it until it finishes.

Each trial trains the same deterministic model (dropout, a shuffling DataLoader, Adam) in a fresh
workspace, SIGKILLs it after a random delay (checkpoint writes are slowed down in the child, so
many kills land inside a save), restarts it, and repeats ``--kills`` times before letting it run to
the end. A trial passes when the final parameters are bitwise equal to an uninterrupted run's,
every restart resumed from a complete checkpoint (or from scratch when none existed yet), and no
checkpoint was ever skipped as incomplete or corrupt.

    python tests/faults/kill_resume.py --trials 200

prints one line per trial and ends with "N passed, N failed"; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import ledger_problem

STEPS = 40
HERE = Path(__file__).resolve()


def child(workspace: Path, out: Path, slow: float) -> None:
    """The training script under test (runs in its own process)."""
    import torch
    from torch import nn

    from tests.slurm.tiny_job import TinyJobTrainer
    from trainfsm import CheckpointingHook
    from trainfsm.checkpoint import io as store

    if slow:  # widen the window in which a kill lands inside a checkpoint write
        finish = store.DurableWriter.finish

        def slow_finish(self: Any) -> str:
            time.sleep(slow)  # the file is written, not yet synced, renamed or pointed at
            return finish(self)

        store.DurableWriter.finish = slow_finish  # type: ignore[method-assign]

    class Trainer(TinyJobTrainer):  # the SLURM job scripts' trainer
        def build_hooks(self) -> list[Any]:
            exit_signals = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
            return [CheckpointingHook(interval=3, keep_previous=1, exit_signals=exit_signals)]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            time.sleep(0.01)  # a step takes a while, like real work
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    torch.manual_seed(1234)
    trainer = Trainer(max_steps=STEPS, workspace=workspace, device="cpu")
    trainer.train()
    torch.save([p.detach() for p in trainer.model.parameters()], out)  # type: ignore[union-attr]


def _launch(workspace: Path, out: Path, slow: float) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(HERE), "--child", "--workspace", str(workspace), "--out", str(out)]
    command += ["--slow", str(slow)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _events(workspace: Path) -> list[dict[str, Any]]:
    from trainfsm.trail.reader import read_events  # tolerates the cut-off last line of a killed writer

    return list(read_events(workspace))


def _last_step(workspace: Path) -> int:
    """The step the restarted process resumes from: that of the newest complete checkpoint."""
    from trainfsm.checkpoint.store import parse_step

    names = [p.parent.name for p in (workspace / "checkpoints").glob("*/manifest.json") if not p.parent.is_symlink()]
    return max((parsed[0] for parsed in map(parse_step, names) if parsed), default=0)


def _count(workspace: Path, name: str) -> int:
    path = workspace / "logs" / "events.rank0.jsonl"
    return path.read_bytes().count(b'"event":"' + name.encode() + b'"') if path.exists() else 0


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its final parameters, how long its training took (RESTORE to EXIT)
    and how long train() took before that (run_start to RESTORE: BUILD)."""

    parameters: list[Any]
    training: float
    startup: float


def reference(directory: Path, slow: float) -> Reference:
    import torch

    out = directory / "reference.pt"
    process = _launch(directory / "reference", out, slow=slow)
    _, err = process.communicate(timeout=300)
    if process.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{err.decode()}")
    events = _events(directory / "reference")
    start, restore, end = (
        next(e["ts"] for e in events if e["event"] == name) for name in ("run_start", "restore", "exit")
    )
    return Reference(torch.load(out), end - restore, restore - start)


def trial(directory: Path, ref: Reference, kills: int, rng: random.Random, slow: float) -> tuple[bool, str, int]:
    import torch

    expected, duration = ref.parameters, ref.training
    workspace, out = directory / "workspace", directory / "final.pt"
    killed = 0
    while True:
        restores = _count(workspace, "restore")
        process = _launch(workspace, out, slow)
        if killed < kills:
            # Kill at a random moment of the training itself, not while Python imports torch.
            while process.poll() is None and _count(workspace, "restore") == restores:
                time.sleep(0.02)
            # Somewhere in what is left of the run: its length scaled by the steps still to go.
            left = 1.0 - _last_step(workspace) / STEPS
            time.sleep(rng.uniform(0.0, 0.9 * left * duration))
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=60)
                killed += 1
                continue
        _, err = process.communicate(timeout=300)
        if process.returncode != 0:
            return False, f"run exited {process.returncode}: {err.decode()[-2000:]}", killed
        break
    events = _events(workspace)
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    if skipped:
        return False, f"a checkpoint was skipped as incomplete: {skipped[0]['reason']}", killed
    attempts = sorted({e["attempt"] for e in events})
    for attempt in attempts[1:]:
        mine = [e for e in events if e["attempt"] == attempt]
        restores = [e for e in mine if e["event"] == "restore"]
        if not restores:
            continue  # killed before it got as far as RESTORE
        loaded = [e for e in mine if e["event"] == "checkpoint_loaded"]
        if restores[0]["resumed"] and not loaded:
            return False, f"attempt {attempt} resumed without loading a checkpoint", killed
    ledger = ledger_problem(workspace)
    if ledger:
        return False, ledger, killed
    final = torch.load(out)
    if not all(torch.equal(a, b) for a, b in zip(final, expected, strict=True)):
        return False, "final parameters differ from the uninterrupted run", killed
    loads = sum(e["event"] == "checkpoint_loaded" for e in events)
    return True, f"{killed} kills, {len(attempts)} attempts, {loads} checkpoint loads", killed


def run_trials(
    trials: int, kills: int, seed: int, slow: float, verbose: bool = True, at_least: int = 0, most: int = 0
) -> tuple[int, int, int]:
    """(passed, failed, SIGKILLs sent) over ``trials`` trials, more (up to ``most``) until ``at_least`` landed."""
    return repeat(trial, trials, kills, seed, slow, verbose, at_least, most)


def repeat(
    one: Callable[..., tuple[bool, str, int]],
    trials: int,
    count: int,
    seed: int,
    slow: float,
    verbose: bool,
    at_least: int = 0,
    most: int = 0,
) -> tuple[int, int, int]:
    """Run ``one`` trial function ``trials`` times against one uninterrupted reference run:
    (passed, failed, interruptions sent in all).

    An interruption drawn for a moment the process has already passed (it finished first) is not
    sent, so how many land is chance. A test that needs ``at_least`` of them runs further trials,
    up to ``most`` in all, rather than hoping the planned count drew few late moments."""
    rng = random.Random(seed)
    passed = failed = total = index = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        ref = reference(base, slow)
        while index < trials or (total < at_least and index < most):
            directory = base / f"trial{index}"
            directory.mkdir()
            ok, detail, sent = one(directory, ref, count, rng, slow)
            total += sent
            passed += ok
            failed += not ok
            if verbose:
                print(f"trial {index}: {'passed' if ok else 'FAILED'} ({detail})", flush=True)
            index += 1
    return passed, failed, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs per trial before it may finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.03, help="seconds added to each checkpoint file's write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.workspace, args.out, args.slow)
        return
    passed, failed, kills = run_trials(args.trials, args.kills, args.seed, args.slow)
    print(f"{kills} SIGKILLs sent")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
