"""DDP at 3 or 4 ranks under torchrun, killed or preempted and relaunched: bit-exact (issue 48).

``examples/ddp.py --hidden 768 3`` (4.8 MB of parameters: two DDP buckets once DDP rebuilt them)
runs under ``torchrun --nproc-per-node N``. A trial launches it, waits for its first checkpoint,
then after a random delay either SIGKILLs the whole job (torchrun and every worker: a lost node,
an OOM kill) or sends SIGUSR1 to torchrun, which forwards it (every rank saves at one agreed step
and exits 138). It relaunches until the run completes, and passes when the final parameters equal
an uninterrupted run's of the same world size bit for bit, each relaunch primed DDP with the saved
gradient order (the ``ddp_buckets`` events), and ``trainfsm audit`` finds no problem.

    python tests/faults/ddp_ranks.py --ranks 4 --faults kill --trials 20
    python tests/faults/ddp_ranks.py --ranks 3 --faults kill,signal --trials 5

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
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import (
    ROOT,
    audit_problems,
    events,
    finish_logged,
    free_port,
    start_logged,
    torchrun_argv,
)
from tests.faults.elastic_restart import reap, workers

EXAMPLE = ROOT / "examples" / "ddp.py"
STEPS, INTERVAL, STEP_SECONDS = 30, 5, 0.03
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: How long one launch may take, start-up included (4 ranks on 2 busy cores start slowly).
LAUNCH_TIMEOUT = 240.0


def launch(workspace: Path, log: Path, ranks: int) -> subprocess.Popen[bytes]:
    command = [*torchrun_argv(), "--rdzv-backend", "static", "--master-port", str(free_port())]
    command += ["--nproc-per-node", str(ranks), f"--signals-to-handle={FORWARDED}", str(EXAMPLE)]
    command += ["--workspace", str(workspace), "--steps", str(STEPS), "--interval", str(INTERVAL)]
    command += [
        "--step-seconds",
        str(STEP_SECONDS),
        "--timeout",
        "30",
        "--stall-timeout",
        "none",
        "--hidden",
        "768",
        "3",
    ]
    return start_logged(command, log)


def finish(workspace: Path, log: Path, ranks: int) -> int | None:
    """Launch and wait for the end; torchrun's exit code (None: timed out, killed)."""
    return finish_logged(launch(workspace, log, ranks), LAUNCH_TIMEOUT)


def reference(directory: Path, ranks: int) -> dict[str, Any]:
    """The uninterrupted run's final parameters."""
    import torch

    workspace = directory / "reference"
    code = finish(workspace, directory / "reference.log", ranks)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run exited {code}:\n{(directory / 'reference.log').read_text()[-3000:]}")
    return torch.load(workspace / "final.pt")


def saved_steps(workspace: Path) -> list[int]:
    root = workspace / "checkpoints"
    found = (p for p in root.iterdir() if p.name.isdigit() and (p / "manifest.json").exists()) if root.exists() else ()
    return sorted(int(p.name) for p in found)


def interrupt(workspace: Path, log: Path, ranks: int, fault: str, rng: random.Random) -> str:
    """One launch, interrupted by ``fault`` once a checkpoint newer than any before exists; "" or
    what went wrong."""
    before = saved_steps(workspace)
    process = launch(workspace, log, ranks)
    known: set[int] = set()
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (saved_steps(workspace)[-1:] > before[-1:]):
            if process.poll() is not None:
                return ""  # it completed before the fault: the relaunch finds nothing to do
            if time.monotonic() > deadline:
                return f"no new checkpoint within {LAUNCH_TIMEOUT:.0f} s"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.6))
        known.update(workers(process.pid))
        if fault == "kill":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # torchrun and its own session's children
            for pid in known:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        else:
            process.send_signal(signal.SIGUSR1)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                return "torchrun did not end within 60 s of SIGUSR1"
    finally:
        reap(process, known)
    return ""


def trial(directory: Path, expected: dict[str, Any], ranks: int, faults: list[str], rng: random.Random) -> str:
    """Each fault in turn, then a launch to the end; "" when the run ended exact and audited clean."""
    import torch

    workspace, log = directory / "workspace", directory / "torchrun.log"
    for fault in faults:
        problem = interrupt(workspace, log, ranks, fault, rng)
        if problem:
            return f"{fault}: {problem}\n{log.read_text(errors='replace')[-3000:]}"
    code = finish(workspace, log, ranks)
    if code != 0:
        return f"the last launch exited {code}:\n{log.read_text(errors='replace')[-3000:]}"
    final = torch.load(workspace / "final.pt")
    differ = [k for k in expected if not torch.equal(final[k], expected[k])]
    if differ:
        worst = max((final[k] - expected[k]).abs().max().item() for k in differ)
        return f"parameters differ from the uninterrupted run's: {differ} (at most {worst:.2e})"
    for rank in range(ranks):
        trail = events(workspace, rank)
        resumed = {e["attempt"] for e in trail if e["event"] == "restore" and e["resumed"]}
        primed = {e["attempt"] for e in trail if e["event"] == "ddp_buckets" and e["action"] == "primed"}
        checked = [e for e in trail if e["event"] == "ddp_buckets" and e["action"] == "checked"]
        if resumed != primed or not all(e["exact"] and e["same_order"] for e in checked):
            return f"rank {rank}: resumed attempts {sorted(resumed)}, primed {sorted(primed)}, checks {checked}"
    problems = audit_problems(workspace)
    return f"audit problems: {problems}" if problems else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, choices=(3, 4), default=4)
    parser.add_argument("--faults", default="kill", help="comma-separated, in order: kill, signal")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    faults = args.faults.split(",")
    if not set(faults) <= {"kill", "signal"}:
        parser.error(f"--faults: kill and/or signal, got {args.faults!r}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job gets it
    passed = failed = 0
    with tempfile.TemporaryDirectory(prefix="ddp-ranks-") as tmp:
        started = time.monotonic()
        expected = reference(Path(tmp), args.ranks)
        print(f"reference: {time.monotonic() - started:.1f} s", flush=True)
        for index in range(args.trials):
            started = time.monotonic()
            problem = trial(Path(tmp) / f"trial{index}", expected, args.ranks, faults, random.Random(args.seed + index))
            passed, failed = passed + (not problem), failed + bool(problem)
            verdict = "passed" if not problem else f"FAILED: {problem}"
            print(
                f"trial {index}: {args.ranks} ranks, {'+'.join(faults)}: {time.monotonic() - started:.1f} s, {verdict}"
            )
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
