"""Kill a rank of a 2-rank FSDP2 run in the middle of a sharded save, resume it, under CPU load:
every process that gets to the end of its run must exit 0.

A clean run used to abort at exit now and then (-6, "terminate called without an active
exception"): FSDP2's device meshes kept the destroyed gloo group alive, and its threads ended in
interpreter shutdown (see ``trainfsm.torch_workarounds``). How often depends on timing, so the
trials run beside one busy process per core.

Each trial runs ``tests/distributed/sharded_worker.py kill`` on 2 gloo ranks in a fresh
directory: a randomly chosen rank dies (``os._exit(9)``) in the middle of the step-4 save,
synchronous or background (``die_rank{0,1}[_async]``); the other rank must fail without hanging.
Then the same command again, with nothing injected: it resumes from step 2 and ends at step 4.
A trial passes when both resumed ranks exit 0, have no gloo thread left after cleanup, and end
with parameters bitwise equal to an uninterrupted run's.

    python tests/faults/fsdp_teardown.py --trials 50
    python tests/faults/fsdp_teardown.py --trials 50 --keep-groups   # without the workaround

prints one line per trial and ends with "N passed, N failed"; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import ROOT, Outcome, run_worker

WORKER = ROOT / "tests" / "distributed" / "sharded_worker.py"
ACTIONS = ("die_rank0", "die_rank1", "die_rank0_async", "die_rank1_async")
ABORTED = (-6, 134)  # SIGABRT, as a signal or as a shell reports it
TIMEOUT = 180.0  # seconds per launch: a loaded 2-core machine imports torch slowly


@contextlib.contextmanager
def cpu_load(processes: int | None = None) -> Iterator[None]:
    """One busy Python loop per core (or ``processes`` of them) while the block runs; each in its
    own process group, killed as a whole when the block ends."""
    count = (os.cpu_count() or 1) if processes is None else processes
    busy = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for proc in busy:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def launch(out: Path, *args: str, keep_groups: bool = False) -> Outcome:
    extra = ("--keep-groups",) if keep_groups else ()
    return run_worker("kill", out, TIMEOUT, *args, *extra, worker=WORKER)


def threads_left(outcome: Outcome) -> list[int | None]:
    """Per rank, the gloo threads it still ran after cleanup (None: it did not get that far)."""
    marker = "gloo threads after cleanup: "
    counts: list[int | None] = []
    for rank in sorted(outcome.stderr):
        lines = [line for line in outcome.stderr[rank].splitlines() if line.startswith(marker)]
        counts.append(int(lines[-1].removeprefix(marker)) if lines else None)
    return counts


def final_params(out: Path, rank: int) -> list[Any]:
    import torch

    result = torch.load(out / f"kill.rank{rank}.pt")["run"]
    if result["error"] is not None:
        raise RuntimeError(f"rank {rank}'s run failed: {result['error']}")
    return list(result["params"])


def clean(outcome: Outcome, what: str) -> str | None:
    """Why a launch that should have ended cleanly did not; None when every rank exited 0."""
    if outcome.hung:
        return f"{what}: ranks {outcome.hung} hung\n{outcome.describe()}"
    if set(outcome.codes.values()) != {0}:
        aborted = [rank for rank, code in outcome.codes.items() if code in ABORTED]
        note = f" (rank {aborted} aborted at exit)" if aborted else ""
        return f"{what}: exit codes {outcome.codes}{note}\n{outcome.describe()}"
    return None


def reference(directory: Path, keep_groups: bool = False) -> list[list[Any]]:
    """Each rank's parameters after the uninterrupted 4-step run."""
    out = directory / "reference"
    problem = clean(launch(out, keep_groups=keep_groups), "the uninterrupted run")
    if problem is not None:
        raise RuntimeError(problem)
    return [final_params(out, rank) for rank in range(2)]


def trial(
    directory: Path, expected: list[list[Any]] | None, rng: random.Random, keep_groups: bool = False
) -> tuple[bool, str]:
    """Kill a rank in the step-4 save, resume; (passed, what happened). ``expected``: each rank's
    parameters after the uninterrupted run, or None not to compare them."""
    import torch

    action = rng.choice(ACTIONS)
    killed = int(action.removeprefix("die_rank")[0])
    first = launch(directory, "--action", action, "--pg-timeout", "10", keep_groups=keep_groups)
    if first.hung or first.codes[killed] != 9 or first.codes[1 - killed] == 0:
        return False, f"{action}: the killed launch ended {first.codes}, hung {first.hung}\n{first.describe()}"
    resumed = launch(directory, keep_groups=keep_groups)
    problem = clean(resumed, f"{action}: the resumed launch")
    if problem is not None:
        return False, problem
    left = threads_left(resumed)
    if not keep_groups and left != [0, 0]:
        return False, f"{action}: gloo threads after cleanup {left} (the group outlived destroy_process_group)"
    for rank, want in enumerate(expected or []):
        got = final_params(directory, rank)
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            return False, f"{action}: rank {rank}'s resumed parameters differ from the uninterrupted run's"
    return True, f"{action}: killed launch {first.codes}, resumed {resumed.codes}, gloo threads left {left}"


def run_trials(trials: int, seed: int = 0, load: int | None = None, keep_groups: bool = False) -> tuple[int, int]:
    """(passed, failed) over ``trials`` trials, under ``load`` busy processes (default: one per core)."""
    rng = random.Random(seed)
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp, cpu_load(load):
        base = Path(tmp)
        expected = reference(base, keep_groups)
        for index in range(trials):
            ok, detail = trial(base / f"trial{index}", expected, rng, keep_groups)
            passed += ok
            failed += not ok
            print(f"trial {index}: {'passed' if ok else 'FAILED'} ({detail})", flush=True)
    return passed, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--load", type=int, default=None, help="busy processes beside the trials (default: one per core)"
    )
    parser.add_argument("--keep-groups", action="store_true", help="workers skip release_destroyed_groups()")
    args = parser.parse_args()
    passed, failed = run_trials(args.trials, args.seed, args.load, args.keep_groups)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
