"""FSDP2 (``fully_shard``) at 3 or 4 ranks under real torchrun: a run SIGKILLed or stopped by SIGUSR1
at a random moment and relaunched ends with the uninterrupted run's model and optimizer state, bit
for bit (``torch.equal``), the uninterrupted run having the same world size.

The workers (this file's ``--child`` mode) run ``examples/fsdp_sharded.py``'s trainer (the data,
AdamW and forward of ``examples/ddp.py``; each Linear its own FSDP unit, then the root), set up by
``init_distributed`` as the example is, with a wider model: Linear(32, 1024), Linear(1024, 1024),
Linear(1024, 4), 1.09 M parameters (4.4 MB; 13 MB with AdamW's moments), so every rank holds a
real shard of each (dim 0 split: 256 rows of the middle weight each at 4 ranks). Checkpoints:

``sharded`` the example's default: every rank writes its own shards with DCP;
``full``    ``state_dict_options=StateDictOptions(full_state_dict=True, cpu_offload=True)``: the
            ranks gather the whole state and rank 0 writes it, as for DDP.

Faults, at a random moment of the first launch:

``kill``    SIGKILL, drawn after the first checkpoint (many land inside a later save): in even
            trials one worker (torchrun then stops the others), in odd trials torchrun and every
            worker at once (a node gone). The relaunch must load the newest complete checkpoint.
``signal``  SIGUSR1 to torchrun, which forwards it (``--signals-to-handle``, as the distributed
            guide says), drawn over the whole training: every rank agrees on one step, rank 0
            saves it once, every worker exits 138. The relaunch must load that step.

A trial passes when the relaunch exits 0 on every rank, loaded the checkpoint it should (sharded
or full, as asked), ends with the uninterrupted run's state bit for bit, and the data ledger shows
every batch drawn once. One uninterrupted launch is the reference of all trials.

    python tests/faults/fsdp_ranks.py --ranks 4 --fault kill --trials 20 [--checkpoint full]

prints one line per trial and ends with "N passed, N failed"; exit status 1 if any failed.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import ROOT, events, free_port, start_logged, torchrun_argv
from tests.faults.elastic_restart import reap, workers
from tests.helpers import ledger_problem

HERE = Path(__file__).resolve()
WIDTH = 1024
#: torchrun's default forwarded signals plus SIGUSR1 (SLURM's usual warning), as the guide says.
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
CHECKPOINTS = ("sharded", "full")
FINAL = "final.pt"


@dataclass(frozen=True)
class Job:
    """What every launch of a trial runs: the world size, the run's length and pace, the checkpoints."""

    ranks: int = 4
    steps: int = 32
    interval: int = 4  # a checkpoint every this many steps
    step_seconds: float = 0.02  # examples/ddp.py's forward sleeps this long: room for a fault
    checkpoint: str = "sharded"
    reorder_on_resume: bool = False

    def args(self) -> list[str]:
        pace = ["--steps", str(self.steps), "--interval", str(self.interval), "--step-seconds", str(self.step_seconds)]
        return [*pace, "--checkpoint", self.checkpoint, *(["--reorder-on-resume"] if self.reorder_on_resume else [])]


# ---------------------------------------------------------------- the workers
def child(args: argparse.Namespace) -> None:
    """One torchrun worker: the reference run first when ``--reference`` names its workspace
    (a fresh trainer from step 0, in these processes, before the run under test), then the run."""
    from datetime import timedelta

    from trainfsm.distributed import cleanup_distributed, init_distributed

    layout = init_distributed("gloo", timeout=timedelta(seconds=30))
    try:
        if args.reference is not None:
            train(layout, args.reference, args)
        train(layout, args.workspace, args)
    finally:
        cleanup_distributed()


def train(layout: Any, workspace: Path, args: argparse.Namespace) -> None:
    """Train in ``workspace`` (resuming from its newest checkpoint); a completed run's rank 0 saves
    the whole final state (model and optimizer, gathered) to ``workspace/final.pt``."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    sys.path.insert(0, str(ROOT / "examples"))
    from fsdp_sharded import FSDPTrainer  # type: ignore[import-not-found]

    from trainfsm.distributed import wrap_model

    class Wide(FSDPTrainer):  # type: ignore[misc]
        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            model = nn.Sequential(
                nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4)
            )
            for layer in model:  # as the example: each Linear its own FSDP unit, then the root
                if isinstance(layer, nn.Linear):
                    wrap_model(layer, "fsdp")
            return wrap_model(model, "fsdp")

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all, on CPU
    options = full if args.checkpoint == "full" else None
    trainer = Wide(
        layout, args.interval, max_steps=args.steps, workspace=workspace, device="cpu", state_dict_options=options
    )
    trainer.step_seconds = args.step_seconds  # examples/ddp.py's forward sleeps this long: room for a fault
    if args.reorder_on_resume and newest_complete(workspace) is not None:
        sum_first_step_backwards(groups=3)
    try:
        trainer.train()  # SIGUSR1: checkpoint at an agreed step, SystemExit(138)
        model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=full)  # collective
        if layout.rank == 0:
            torch.save({"model": model, "optimizer": optimizer}, workspace / FINAL)
        torch.distributed.barrier()  # leave together: gloo may abort a rank whose peer tore down first
    finally:
        del trainer  # the model holds the process group: see cleanup_distributed


def sum_first_step_backwards(groups: int) -> None:
    """``--reorder-on-resume``, the check's own check: a relaunched process sums its first step's
    gradients in another order than gloo's reduce-scatter (each rank adds its part of every rank's
    gradient from the last rank to the first), as a resumed DDP does with its first bucket layout.
    Then every trial fails at 3 ranks or more and passes at 2, where each sum has two terms, which
    add the same either way round. Replaces FSDP2's private ``DefaultReduceScatter.__call__`` (torch
    2.13) for its first ``groups`` calls: one per FSDP unit with parameters, the first step's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    comm = _fsdp_collectives.DefaultReduceScatter
    original = comm.__call__
    left = [groups]

    def backwards(
        self: Any, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:  # FSDP2 passes these by name
        if left[0] == 0:
            return original(self, output_tensor, input_tensor, group, op, async_op)
        left[0] -= 1
        world, me, n = group.size(), group.rank(), output_tensor.numel()
        parts = [torch.empty_like(input_tensor) for _ in range(world)]
        dist.all_gather(parts, input_tensor.contiguous(), group=group)
        mine = [part.view(-1)[me * n : (me + 1) * n] for part in parts]
        total = mine[-1].clone()
        for part in reversed(mine[:-1]):
            total += part
        output_tensor.view(-1).copy_(total / world)  # FSDP2 averages (ReduceOp.AVG) in float32
        return original(self, output_tensor.clone(), input_tensor, group, op, async_op)  # a Work to wait on

    comm.__call__ = backwards  # type: ignore[method-assign,assignment]


# ---------------------------------------------------------------- launching
def torchrun(workspace: Path, log: Path, job: Job, *extra: str) -> Any:
    command = [*torchrun_argv(), "--rdzv-backend", "static", "--master-port", str(free_port())]
    command += ["--nproc-per-node", str(job.ranks), "--monitor-interval", "0.1", "--signals-to-handle", FORWARDED]
    command += [str(HERE), "--child", "--workspace", str(workspace), *job.args(), *extra]
    return start_logged(command, log)


def finish(process: Any, known: set[int], timeout: float) -> int | None:
    """torchrun's exit code, None if it still ran after ``timeout`` s; its workers reaped either way."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
    code = process.poll()
    reap(process, known)
    return code


def last_attempt(workspace: Path, rank: int) -> list[dict[str, Any]]:
    trail = events(workspace, rank)
    return [e for e in trail if e["attempt"] == trail[-1]["attempt"]] if trail else []


def wait_for(workspace: Path, ranks: int, event: str, process: Any, known: set[int], timeout: float = 180) -> float:
    """Wait until every rank's newest attempt has ``event`` (noting torchrun's workers meanwhile);
    when rank 0's was written (its ``ts``)."""
    deadline = time.monotonic() + timeout
    while True:
        known.update(workers(process.pid))
        found = [next((e["ts"] for e in last_attempt(workspace, r) if e["event"] == event), None) for r in range(ranks)]
        if None not in found:
            return float(found[0])  # type: ignore[arg-type]
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"not every rank reached {event!r} (torchrun: {process.poll()})")
        time.sleep(0.02)


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its final state, and on rank 0 the seconds from RESTORE to its first
    checkpoint and to its exit."""

    state: dict[str, Any]
    first_save: float
    training: float


def read_reference(workspace: Path) -> Reference:
    import torch

    trail = events(workspace, 0)
    restore = next(e["ts"] for e in trail if e["event"] == "restore")
    saved = next(e["ts"] for e in trail if e["event"] == "checkpoint_saved")
    end = next(e["ts"] for e in trail if e["event"] == "exit")
    return Reference(torch.load(workspace / FINAL), saved - restore, end - restore)


def reference(directory: Path, job: Job) -> Reference:
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "torchrun.log"
    process = torchrun(directory / "workspace", log, job)
    code = finish(process, set(), 300)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run exited {code}:\n{log.read_text(errors='replace')[-3000:]}")
    return read_reference(directory / "workspace")


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where ``got`` and ``want`` (nested dicts and lists of tensors and plain values) differ:
    tensors by ``torch.equal``, with the largest difference; [] when equal bit for bit."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return [f"{where}: {got!r:.60} against {want!r:.60}"]
        if torch.equal(got, want):
            return []
        return [f"{where}: differs by up to {(got.double() - want.double()).abs().max().item():.3g}"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{where}: keys differ"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}".lstrip("."))]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where}: lengths differ"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} against {want!r}"]


def newest_complete(workspace: Path) -> int | None:
    complete = (workspace / "checkpoints").glob("*/manifest.json")
    return max((int(p.parent.name) for p in complete if p.parent.name.isdigit()), default=None)


# ---------------------------------------------------------------- one trial
@dataclass
class Trial:
    """What a trial did, for its line."""

    problem: str = ""
    fault: str = ""
    resumed_from: int | None = None
    seconds: float = 0.0

    def line(self, index: int) -> str:
        what = f"passed ({self.fault}; resumed from step {self.resumed_from})" if not self.problem else "FAILED"
        return f"trial {index}: {what} in {self.seconds:.1f} s" + (f": {self.problem}" if self.problem else "")


def trial(directory: Path, ref: Reference | None, job: Job, fault: str, rng: random.Random, index: int) -> Trial:
    """One fault and its relaunch in ``directory``. ``ref``: the uninterrupted run; None to train it
    in the first launch's processes, before the run under test (one launch fewer)."""
    started = time.monotonic()
    result = Trial()
    try:
        result.problem = interrupt(directory, ref, job, fault, rng, index, result)
        if not result.problem:
            result.problem = relaunch(directory, ref or read_reference(directory / "reference"), job, result)
    except RuntimeError as exc:
        result.problem = str(exc)
    result.seconds = time.monotonic() - started
    return result


def interrupt(
    directory: Path, ref: Reference | None, job: Job, fault: str, rng: random.Random, index: int, result: Trial
) -> str:
    """The first launch, and its fault; "" when it ended as the fault should end it (the step to
    resume from in ``result``), else what went wrong."""
    directory.mkdir(parents=True, exist_ok=True)
    workspace, log = directory / "workspace", directory / "torchrun.log"
    extra = ("--reference", str(directory / "reference")) if ref is None else ()
    process = torchrun(workspace, log, job, *extra)
    known: set[int] = set()
    try:
        restored = wait_for(workspace, job.ranks, "restore", process, known)
        # The fault is drawn over what the reference's training says is left of this one. A run
        # after the reference in the same processes skips their first-step costs and ends sooner.
        reach = 0.9 if ref is not None else 0.5
        ref = ref or read_reference(directory / "reference")
        if fault == "kill":  # after the first checkpoint
            while newest_complete(workspace) is None:
                if process.poll() is not None:
                    return f"torchrun ended ({process.poll()}) before the first checkpoint\n{tail(log)}"
                time.sleep(0.01)
        time.sleep(rng.uniform(0.0, reach * max(0.0, ref.training - (time.time() - restored))))
        known.update(workers(process.pid))
        if fault == "signal":
            result.fault = "SIGUSR1 to torchrun"
            process.send_signal(signal.SIGUSR1)
        elif index % 2 == 0:
            victim = rng.choice(sorted(known))
            result.fault = f"SIGKILL to rank {worker_rank(victim)}"
            os.kill(victim, signal.SIGKILL)  # torchrun then stops the other workers and exits 1
        else:
            result.fault = "SIGKILL to torchrun and every worker"
            for pid in [*known, process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        code = finish(process, known, 90)
    finally:
        reap(process, known)
    if code is None:
        return f"torchrun still ran 90 s after the {result.fault}\n{tail(log)}"
    if code == 0:
        return f"the first launch completed before the fault ({result.fault})"
    if fault == "kill":
        result.resumed_from = newest_complete(workspace)
        return ""
    agreed = signal_outcome(workspace, job.ranks)
    if isinstance(agreed, str):
        return f"{agreed}\n{tail(log)}"
    result.resumed_from = agreed
    return ""


def relaunch(directory: Path, ref: Reference, job: Job, result: Trial) -> str:
    """The same command again, to the end: "" when it resumed from ``result.resumed_from`` and
    ended with the reference's state, else what went wrong."""
    import torch

    workspace, log = directory / "workspace", directory / "torchrun.log"
    code = finish(torchrun(workspace, log, job), set(), 300)
    if code != 0:
        return f"the relaunch exited {code}\n{tail(log)}"
    for rank in range(job.ranks):
        ends = [(e["reason"], e["code"]) for e in last_attempt(workspace, rank) if e["event"] == "exit"]
        if ends != [("completed", 0)]:
            return f"rank {rank}'s relaunch ended {ends}"
    loaded = [e for e in last_attempt(workspace, 0) if e["event"] == "checkpoint_loaded"]
    expected = [result.resumed_from] if result.resumed_from is not None else []
    if [e["from_step"] for e in loaded] != expected:
        return f"the relaunch loaded {[e['from_step'] for e in loaded]}, expected {expected}"
    if loaded and bool(loaded[0].get("sharded")) != (job.checkpoint == "sharded"):
        return f"the relaunch loaded a checkpoint with sharded={loaded[0].get('sharded')}, expected {job.checkpoint}"
    diff = differences(torch.load(workspace / FINAL), ref.state)
    if diff:
        return f"the final state differs from the uninterrupted run's in {len(diff)} entries: {diff[:4]}"
    return ledger_problem(workspace)


def signal_outcome(workspace: Path, ranks: int) -> int | str:
    """The step every rank agreed on and rank 0 saved once; else what went wrong."""
    agreed, exits = set(), set()
    for rank in range(ranks):
        mine = last_attempt(workspace, rank)
        if not any(e["event"] == "exit" for e in mine):
            return f"rank {rank} has no exit event"
        agreed |= {e["agreed_step"] for e in mine if e["event"] == "signal_agreed"}
        exits |= {(e["reason"], e["code"]) for e in mine if e["event"] == "exit"}
    if len(agreed) != 1 or exits != {("preempted", 128 + signal.SIGUSR1)}:
        return f"the ranks agreed on {sorted(agreed)} and exited {sorted(exits)}, expected one step and preempted 138"
    (step,) = agreed
    saved = [e["saved_step"] for e in last_attempt(workspace, 0) if e["event"] == "checkpoint_saved"]
    if saved[-1:] != [step] or saved.count(step) != 1:
        return f"rank 0 saved {saved}, expected step {step} once"
    return int(step)


def worker_rank(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def run_trials(job: Job, fault: str, trials: int, seed: int = 0) -> tuple[int, int]:
    """(passed, failed) over ``trials`` trials against one uninterrupted launch; a line per trial."""
    rng = random.Random(seed)
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        ref = reference(base / "reference", job)
        print(f"reference: {job}, training {ref.training:.1f} s", flush=True)
        for index in range(trials):
            outcome = trial(base / f"trial{index}", ref, job, fault, rng, index)
            passed += not outcome.problem
            failed += bool(outcome.problem)
            print(outcome.line(index), flush=True)
    return passed, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=Job.ranks, help="the world size (3, 4; 2 for comparison)")
    parser.add_argument("--fault", choices=("kill", "signal"), default="kill")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default=Job.checkpoint)
    parser.add_argument("--steps", type=int, default=Job.steps)
    parser.add_argument("--interval", type=int, default=Job.interval, help="checkpoint every this many steps")
    parser.add_argument("--step-seconds", type=float, default=Job.step_seconds)
    parser.add_argument(
        "--reorder-on-resume", action="store_true", help="the check's own check: see sum_first_step_backwards"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reference", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    started = time.monotonic()
    job = Job(args.ranks, args.steps, args.interval, args.step_seconds, args.checkpoint, args.reorder_on_resume)
    passed, failed = run_trials(job, args.fault, args.trials, args.seed)
    print(f"{passed} passed, {failed} failed in {time.monotonic() - started:.0f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
