"""torchrun's elastic restarts: SIGKILL one rank (or make it raise) at a random moment, let torchrun
restart the group, and check that the restarted group completes with the uninterrupted run's
parameters, bit for bit.

Each trial launches ``torchrun --nproc-per-node 2 --max-restarts 2`` (static rendezvous on a free
port, or ``--standalone``'s c10d rendezvous, alternating) over this file's ``--child`` mode: the
DDP trainer of ``examples/ddp.py``, set up with ``trainfsm.distributed.init_distributed``. Once the
first attempt is training, after a random delay over its training, one worker (chosen at random) is
SIGKILLed, or with ``--fault raise`` rank 1 raises at a random step of the first attempt. A trial
passes when torchrun exits 0, the trail of every rank has a second attempt with
``run_start.torchelastic.restart_count == 1`` that resumed from a checkpoint (or started afresh
before the first one), and the final parameters equal the uninterrupted run's.

    python tests/faults/elastic_restart.py --trials 50 [--fault raise]

prints one line per trial and ends with "N passed, N failed"; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import ROOT, events, free_port
from tests.helpers import ledger_problem

HERE = Path(__file__).resolve()
STEPS, INTERVAL, STEP_SECONDS = 40, 10, 0.03


INITS = ("trainfsm", "tcp", "env")


def child(workspace: Path, raise_at: int, init: str = "trainfsm", every_attempt: bool = False) -> None:
    """One torchrun worker: examples/ddp.py's trainer; rank 1 raises at ``raise_at`` in attempt 0
    (in every attempt with ``every_attempt``).

    ``init`` sets up the group: ``trainfsm`` with ``init_distributed`` (a store prefix per restart);
    for comparison ``tcp`` as ``init_distributed`` did before it (``tcp://MASTER_ADDR:MASTER_PORT``)
    and ``env`` with a plain ``init_process_group("gloo")``."""
    from datetime import timedelta

    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from ddp import DDPTrainer  # type: ignore[import-not-found]

    from trainfsm.distributed import cleanup_distributed, init_distributed

    class Faulty(DDPTrainer):  # type: ignore[misc]
        def forward(self, input: Any) -> Any:
            first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
            if (first or every_attempt) and self.rank == 1 and self.step == raise_at:
                raise RuntimeError(f"injected failure at step {raise_at}")
            return super().forward(input)

    if init == "trainfsm":
        layout = init_distributed("gloo", timeout=timedelta(seconds=30))
    else:
        from trainfsm.distributed import read_env

        layout = read_env()
        assert layout is not None
        where = f"tcp://{layout.master_addr}:{layout.master_port}" if init == "tcp" else "env://"
        torch.distributed.init_process_group(
            "gloo", init_method=where, rank=layout.rank, world_size=layout.world_size, timeout=timedelta(seconds=30)
        )
    trainer = Faulty(layout, INTERVAL, STEP_SECONDS, max_steps=STEPS, workspace=workspace, device="cpu")
    trainer.train()
    torch.distributed.barrier()
    if trainer.rank == 0:
        torch.save([p.detach() for p in trainer.unwrapped_model.parameters()], workspace / "final.pt")
    del trainer
    cleanup_distributed()


def torchrun(
    workspace: Path, standalone: bool, raise_at: int, log: Path, init: str = "trainfsm", *child_args: str
) -> Any:
    import subprocess

    launcher = Path(sys.executable).with_name("torchrun")
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    rendezvous = ["--standalone"] if standalone else ["--rdzv-backend", "static", "--master-port", str(free_port())]
    command += [
        *rendezvous,
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.1",
    ]
    command += [str(HERE), "--child", "--workspace", str(workspace), "--raise-at", str(raise_at), "--init", init]
    command += child_args
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    with open(log, "wb") as out:  # a file, not a pipe nobody reads
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def workers(launcher_pid: int) -> list[int]:
    """The launcher's worker processes (its children)."""
    children = []
    for task in Path(f"/proc/{launcher_pid}/task").glob("*"):
        try:
            children += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(children))


def reap(process: Any, known: Iterable[int] = ()) -> None:
    """Kill torchrun and its workers (those alive now, and the ``known`` ones: once torchrun is
    gone its workers are nobody's children). They run in sessions of their own and may outlive it."""
    for pid in {process.pid, *workers(process.pid), *known}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


def run(directory: Path, standalone: bool, raise_at: int, timeout: float = 240) -> tuple[int | None, str]:
    workspace = directory / "workspace"
    log = directory / "torchrun.log"
    process = torchrun(workspace, standalone, raise_at, log)
    try:
        process.wait(timeout=timeout)
    except Exception:
        reap(process)
        return None, log.read_text(errors="replace")
    return process.returncode, log.read_text(errors="replace")


def reference(directory: Path) -> tuple[list[Any], float]:
    import torch

    code, output = run(directory, standalone=True, raise_at=-1)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run failed ({code}):\n{output[-3000:]}")
    trail = events(directory / "workspace", 0)
    start = next(e["ts"] for e in trail if e["event"] == "restore")
    end = next(e["ts"] for e in trail if e["event"] == "exit")
    return torch.load(directory / "workspace" / "final.pt"), end - start


def trial(
    directory: Path, expected: list[Any], duration: float, fault: str, rng: random.Random, index: int, init: str
) -> str:
    """ "" when the trial passed, else what went wrong."""
    import torch

    workspace = directory / "workspace"
    standalone = index % 2 == 1
    raise_at = rng.randint(2, STEPS - 2) if fault == "raise" else -1
    log = directory / "torchrun.log"
    process = torchrun(workspace, standalone, raise_at, log, init)
    try:
        if fault == "kill":
            deadline = time.monotonic() + 120
            while not any(e["event"] == "restore" for e in events(workspace, 0)):
                if process.poll() is not None or time.monotonic() > deadline:
                    return f"the first attempt never started training: {log.read_text()[-2000:]}"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.9 * duration))
            pids = workers(process.pid)
            if not pids:
                return "no worker to kill"
            os.kill(rng.choice(pids), signal.SIGKILL)
        process.wait(timeout=240)
    except Exception as exc:
        reap(process)
        return f"torchrun did not finish: {exc!r}\n{log.read_text(errors='replace')[-3000:]}"
    output = log.read_text(errors="replace")
    if process.returncode != 0:
        return f"torchrun exited {process.returncode}:\n{output[-3000:]}"
    for rank in (0, 1):
        trail = events(workspace, rank)
        starts = [e for e in trail if e["event"] == "run_start"]
        counts = [(e["torchelastic"] or {}).get("restart_count") for e in starts]
        if counts[:1] != [0] or 1 not in counts:
            return f"rank {rank}: run_start restart counts {counts}, expected a first launch and a restart"
    final = torch.load(workspace / "final.pt")
    if not all(torch.equal(a, b) for a, b in zip(final, expected, strict=True)):
        return "final parameters differ from the uninterrupted run"
    from trainfsm.tools import audit, trace

    text = audit.render(audit.audit([workspace]))
    if "torchrun restart 1 of at most 2, after attempt 0 ended: rank 0 " not in text:
        return f"the audit does not show the restart and how attempt 0 ended:\n{text}"
    if "(torchrun restart 1)" not in trace.render(trace.trace([workspace])):
        return "the trace does not name the restart"
    return ledger_problem(workspace)


def run_trials(
    trials: int, seed: int, fault: str = "kill", verbose: bool = True, init: str = "trainfsm"
) -> tuple[int, int]:
    rng = random.Random(seed)
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "reference").mkdir()
        expected, duration = reference(base / "reference")
        for index in range(trials):
            directory = base / f"trial{index}"
            directory.mkdir()
            problem = trial(directory, expected, duration, fault, rng, index, init)
            passed += not problem
            failed += bool(problem)
            if verbose:
                how = "standalone (c10d)" if index % 2 else "static"
                print(
                    f"trial {index} [{fault}, {how}]: {'passed' if not problem else 'FAILED: ' + problem}", flush=True
                )
    return passed, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault", choices=("kill", "raise"), default="kill")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--raise-at", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--init", choices=INITS, default="trainfsm", help="how the workers set up the group")
    parser.add_argument("--every-attempt", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.workspace, args.raise_at, args.init, args.every_attempt)
        return
    passed, failed = run_trials(args.trials, args.seed, args.fault, init=args.init)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
