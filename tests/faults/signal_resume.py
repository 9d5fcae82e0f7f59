"""Send SIGTERM, SIGUSR1 or SIGINT to a real training process at random moments, then resume.

Each trial runs the deterministic script of ``kill_resume.py`` (its CheckpointingHook exits on
these three signals), signals it ``--signals`` times at random moments of its training, restarts
it after each exit, and lets the last run finish. A trial passes when every signalled run exited
with ``128 + signal``, saved a checkpoint exactly at the step where the signal was agreed, and the
final parameters are bitwise equal to an uninterrupted run's.

    python tests/faults/signal_resume.py --trials 200

prints one line per trial and ends with "N passed, N failed"; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.kill_resume import STEPS, _count, _events, _last_step, _launch, repeat

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def trial(
    directory: Path, expected: list[Any], duration: float, signals: int, rng: random.Random, slow: float
) -> tuple[bool, str, int]:
    import torch

    workspace, out = directory / "workspace", directory / "final.pt"
    sent = 0
    while True:
        attempt = _count(workspace, "run_start")
        restores = _count(workspace, "restore")
        process = _launch(workspace, out, slow)
        sig = None
        if sent < signals:
            while process.poll() is None and _count(workspace, "restore") == restores:
                time.sleep(0.02)
            left = 1.0 - _last_step(workspace) / STEPS
            time.sleep(rng.uniform(0.0, 0.9 * left * duration))
            if process.poll() is None:
                sig = rng.choice(SIGNALS)
                process.send_signal(sig)
        _, err = process.communicate(timeout=120)
        if sig is None:
            if process.returncode != 0:
                return False, f"run exited {process.returncode}: {err.decode()[-2000:]}", sent
            break
        sent += 1
        mine = [e for e in _events(workspace) if e["attempt"] == attempt]
        agreed = [e for e in mine if e["event"] == "signal_agreed"]
        if not agreed:
            # The run was already leaving (its last step done, or past train() with the handlers
            # restored, where the default action applies); what it saved is complete either way.
            if process.returncode not in (0, 128 + sig, -sig):
                return False, f"{sig.name} at the end: exit {process.returncode}: {err.decode()[-1500:]}", sent
            if process.returncode == 0 and out.exists():
                break
            continue
        if process.returncode != 128 + sig:
            return False, f"{sig.name}: exit {process.returncode}, expected {128 + sig}: {err.decode()[-1500:]}", sent
        saved = [e["saved_step"] for e in mine if e["event"] == "checkpoint_saved"]
        if not saved or saved[-1] != agreed[0]["agreed_step"]:
            return False, f"{sig.name}: agreed at step {agreed[0]['agreed_step']}, last save at {saved[-1:]}", sent
    final = torch.load(out)
    if not all(torch.equal(a, b) for a, b in zip(final, expected, strict=True)):
        return False, "final parameters differ from the uninterrupted run", sent
    return True, f"{sent} signals", sent


def run_trials(trials: int, signals: int, seed: int, slow: float, verbose: bool = True) -> tuple[int, int, int]:
    """(passed, failed, signals sent) over ``trials`` trials."""
    return repeat(trial, trials, signals, seed, slow, verbose)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--signals", type=int, default=2, help="signals per trial before it may finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.03, help="seconds added to each checkpoint file's write")
    args = parser.parse_args()
    passed, failed, sent = run_trials(args.trials, args.signals, args.seed, args.slow)
    print(f"{sent} signals sent")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
