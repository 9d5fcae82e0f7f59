"""A completed, resumed four-rank DDP run under torchrun: every worker must exit 0.

Now and then one rank of a run whose trail said ``completed`` aborted at exit ("terminate called
without an active exception", status -6), and torchrun reported the job failed. How often depends
on timing, so the trials can run beside busy processes (``--load``).

Each trial runs ``examples/ddp.py`` (``init_distributed``, its default ``CheckpointingHook``,
``cleanup_distributed`` at the end) under ``torchrun --nproc-per-node 4`` in a fresh workspace:
first to a random step k (a checkpoint at k), then the same command again with more steps, which
resumes from k and runs to completion. A trial passes when both launches exit 0, no worker is in
torchrun's failure report, and every rank's trail ends each launch with ``exit`` reason
``completed`` code 0.

    python tests/faults/exit_abort.py --trials 50 --load        # one busy process per core
    python tests/faults/exit_abort.py --trials 20 --load 4 --watch --cores

``--watch`` runs the example through this file (``--child``), which reports after the example's
``main()`` returned, and again at the interpreter's exit, the native threads the worker still has
and, when a gloo thread is among them, what still holds a process group. ``--cores`` lets the
workers dump core (in the trial's directory) and prints every aborted worker's threads from
``gdb`` (when installed). Prints one line per trial and ends with "N passed, N failed" and the
workers' exit statuses; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import ROOT, events, free_port, start_logged, torchrun_argv
from tests.faults.elastic_restart import reap
from tests.faults.fsdp_teardown import cpu_load

HERE = Path(__file__).resolve()
EXAMPLE = ROOT / "examples" / "ddp.py"
NPROC = 4
STEPS = 40
TIMEOUT = 300.0  # seconds per launch: four ranks importing torch on a loaded 2-core machine
ABORTED = (-6, 134)  # SIGABRT, as a signal or as a shell reports it
#: torchrun's failure report names each failed worker: "rank : 2 (local_rank: 2)" then "exitcode : -6 (pid: N)".
FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:.*?\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
#: What ``--child`` prints: "exit-watch rank R after main: gloo=N threads=[...]".
WATCH = re.compile(r"exit-watch rank (\d+) (after main|at exit): gloo=(\d+)")
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


@dataclass(frozen=True)
class Setup:
    """How each launch runs: the script, its extra arguments, ``--watch`` and ``--cores``."""

    example: Path = EXAMPLE
    extra: tuple[str, ...] = ()
    watch: bool = False
    cores: bool = False


def torchrun(workspace: Path, log: Path, steps: int, interval: int, setup: Setup) -> subprocess.Popen[bytes]:
    command = [*torchrun_argv(), "--rdzv-backend", "static", "--master-port", str(free_port())]
    command += ["--nproc-per-node", str(NPROC), "--monitor-interval", "0.1"]
    command += [str(HERE), "--child", str(setup.example)] if setup.watch else [str(setup.example)]
    command += ["--workspace", str(workspace), "--steps", str(steps), "--interval", str(interval)]
    command += ["--timeout", "60", *setup.extra]

    def unlimited_core() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    # cwd: where a worker's core goes (kernel.core_pattern "core")
    return start_logged(command, log, cwd=log.parent, preexec_fn=unlimited_core if setup.cores else None)


def failures(text: str) -> dict[int, tuple[int, int]]:
    """rank -> (exit status, pid) of every worker in torchrun's failure report."""
    return {int(rank): (int(code), int(pid)) for rank, code, pid in FAILURE.findall(text)}


def backtraces(directory: Path, pids: list[int]) -> str:
    """gdb's threads of each aborted worker's core, if there is one (and gdb)."""
    gdb = shutil.which("gdb")
    found = []
    for pid in pids:
        core = next((p for p in (directory / f"core.{pid}", directory / "core") if p.exists()), None)
        if core is None or gdb is None:
            found.append(f"pid {pid}: no core ({'no gdb' if gdb is None else 'none written'})")
            continue
        shown = subprocess.run(
            [gdb, "-q", "-batch", "-ex", "info threads", "-ex", "thread apply all bt 30", sys.executable, str(core)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        kept = core.with_name(f"core.{pid}.bt.txt")
        kept.write_text(shown.stdout + shown.stderr)
        found.append(f"pid {pid}: {kept}\n{shown.stdout[-6000:]}")
        core.unlink()
    return "\n".join(found)


def launch(
    workspace: Path, directory: Path, name: str, steps: int, interval: int, setup: Setup
) -> tuple[dict[int, int], list[str], str]:
    """One torchrun launch: (each rank's worker exit status, the watch's findings, a problem or '')."""
    log = directory / f"{name}.log"
    process = torchrun(workspace, log, steps, interval, setup)
    try:
        code: int | None = process.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        reap(process)  # workers run in torchrun's session and may outlive it
    text = log.read_text(errors="replace")
    failed = failures(text)
    statuses = {rank: failed.get(rank, (0, 0))[0] for rank in range(NPROC)}
    problems = []
    if code is None:
        problems.append(f"{name}: torchrun still ran after {TIMEOUT:.0f} s")
    elif code != 0:
        problems.append(f"{name}: torchrun exit {code}, workers {statuses}")
    for rank in range(NPROC):
        trail = events(workspace, rank)
        exits = [(e["step"], e["reason"], e["code"]) for e in trail if e["event"] == "exit"]
        if not exits or exits[-1] != (steps, "completed", 0):
            problems.append(f"{name}: rank {rank}'s trail ends with exit {exits[-1:] or 'none'}")
    watched = [f"{name}: rank {r} {when}: {n} gloo threads" for r, when, n in WATCH.findall(text) if int(n)]
    if problems:
        aborted = [pid for status, pid in failed.values() if status in ABORTED]
        detail = backtraces(directory, aborted) if setup.cores and aborted else ""
        problems.append(f"---- {log} (tail)\n{text[-4000:]}\n{detail}")
    return statuses, watched, "\n".join(problems)


def trial(directory: Path, rng: random.Random, setup: Setup) -> tuple[bool, dict[int, int], list[str], str]:
    """Run to a random step k (saved), then relaunch to STEPS: (passed, {exit status: workers},
    the watch's findings, what happened)."""
    directory.mkdir(parents=True)
    workspace = directory / "ws"
    k = rng.randrange(5, STEPS - 5)
    statuses: collections.Counter[int] = collections.Counter()
    watched: list[str] = []
    details = []
    for name, steps in (("first", k), ("resumed", STEPS)):
        codes, seen, problem = launch(workspace, directory, name, steps, k, setup)
        statuses.update(codes.values())
        watched += seen
        if problem:
            details.append(problem)
    loaded = [e["from_step"] for e in events(workspace, 0) if e["event"] == "checkpoint_loaded"]
    if loaded != [k]:
        details.append(f"the relaunch loaded {loaded}, expected [{k}]")
    return not details, dict(statuses), watched, "\n".join(details) or f"stopped at {k}, resumed to {STEPS}"


def run_trials(
    trials: int, seed: int = 0, load: int = 0, setup: Setup = Setup(), keep: Path | None = None
) -> tuple[int, int, dict[int, int]]:
    """(passed, failed, {worker exit status: count}) over ``trials`` trials beside ``load`` busy processes."""
    rng = random.Random(seed)
    passed = failed = 0
    statuses: collections.Counter[int] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp, cpu_load(load):
        base = keep or Path(tmp)
        for index in range(trials):
            start = time.monotonic()
            ok, codes, watched, detail = trial(base / f"trial{index}", rng, setup)
            passed += ok
            failed += not ok
            statuses.update(codes)
            took = time.monotonic() - start
            seen = f"; {'; '.join(watched)}" if watched else ""
            print(f"trial {index}: {'passed' if ok else 'FAILED'} in {took:.0f} s, workers {codes}{seen} ({detail})")
            sys.stdout.flush()
    return passed, failed, dict(statuses)


# ---------------------------------------------------------------- --child: the example, watched
def native_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue
    return sorted(names)


def holders() -> str:
    """What refers to each process group object still alive (gloo's threads run while one does).
    Collects nothing: garbage that only the interpreter's shutdown would free is what is looked for."""
    import gc

    found = []
    for obj in gc.get_objects():
        if type(obj).__name__ in ("ProcessGroup", "ProcessGroupGloo"):
            found.append(f"{type(obj).__name__} held by {[type(r).__name__ for r in gc.get_referrers(obj)][:8]}")
    return "; ".join(found) or "no process group object"


def watch(when: str) -> None:
    threads = native_threads()
    gloo = sum(name in GLOO_THREADS for name in threads)
    rank = os.environ.get("RANK", "?")
    held = f" {holders()}" if gloo else ""
    print(f"exit-watch rank {rank} {when}: gloo={gloo} threads={threads}{held}", file=sys.stderr, flush=True)


def child(example: str) -> None:
    """Run ``example`` as ``__main__`` (its arguments after it), then watch what is left."""
    import atexit
    import runpy

    sys.argv = [example, *sys.argv[3:]]
    atexit.register(watch, "at exit")  # registered first: runs last, after the others
    try:
        runpy.run_path(example, run_name="__main__")
    finally:
        watch("after main")


def main(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--load",
        type=int,
        nargs="?",
        const=os.cpu_count() or 1,
        default=0,
        help="busy processes beside the trials (--load alone: one per core)",
    )
    parser.add_argument("--hidden", nargs=2, metavar=("WIDTH", "LAYERS"), help="the example's --hidden")
    parser.add_argument("--watch", action="store_true", help="report the threads and groups left after main()")
    parser.add_argument("--cores", action="store_true", help="keep aborted workers' cores and print their threads")
    parser.add_argument("--keep", type=Path, default=None, help="run the trials in this directory and keep it")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the script torchrun runs (a variant of ddp.py)")
    args = parser.parse_args(argv)
    extra = ("--hidden", *args.hidden) if args.hidden else ()
    setup = Setup(args.example.resolve(), extra, args.watch, args.cores)
    start = time.monotonic()
    passed, failed, statuses = run_trials(args.trials, args.seed, args.load, setup, args.keep)
    print(f"worker exit statuses: {dict(sorted(statuses.items()))}; {time.monotonic() - start:.0f} s")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
