"""Stalls under torchrun (issue 33): two gloo ranks of ``examples/ddp.py``'s DDP trainer, with the
stall watchdog on, and a rank that stops: frozen with SIGSTOP by the test, or a ``forward`` that
sleeps (``--sleep-rank R --sleep-at STEP --sleep SECONDS``, in the first attempt only).

``--child`` is the torchrun worker; the test module (``tests/test_watchdog_distributed.py``)
launches it with ``torchrun(...)`` below, freezes and reaps workers, and reads the trails. Each
worker writes its pid to ``WORKSPACE/pid.rank{R}`` so the test can freeze a chosen rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import ROOT, free_port

HERE = Path(__file__).resolve()
STEPS, INTERVAL, STEP_SECONDS = 60, 10, 0.05


def child(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from ddp import DDPTrainer  # type: ignore[import-not-found]

    from trainfsm.distributed import cleanup_distributed, init_distributed

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"

    class Stalling(DDPTrainer):  # type: ignore[misc]
        def forward(self, input: Any) -> Any:
            if first_attempt and self.rank == args.sleep_rank and self.step == args.sleep_at:
                args.sleep_at = -1
                time.sleep(args.sleep)  # the forward that stalls
            return super().forward(input)

    # What the first optimizer step imports (torch's compiler modules: seconds on a busy machine)
    # happens before BUILD, whose budget is the test's few seconds too.
    parameter = torch.zeros(1, requires_grad=True)
    parameter.sum().backward()
    torch.optim.SGD([parameter], lr=0.1).step()

    layout = init_distributed("gloo", timeout=timedelta(seconds=args.timeout))
    workspace: Path = args.workspace
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / f"pid.rank{layout.rank}").write_text(str(os.getpid()))
    trainer = Stalling(
        layout,
        INTERVAL,
        STEP_SECONDS,
        max_steps=STEPS,
        workspace=workspace,
        device="cpu",
        stall_timeout=args.stall_timeout,
        stall_action=args.stall_action,
    )
    trainer.train()
    torch.distributed.barrier()
    if trainer.rank == 0:
        torch.save([p.detach() for p in trainer.unwrapped_model.parameters()], workspace / "final.pt")
    del trainer
    cleanup_distributed()


def torchrun(workspace: Path, log: Path, *child_args: str, max_restarts: int = 0) -> subprocess.Popen[bytes]:
    launcher = Path(sys.executable).with_name("torchrun")
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--rdzv-backend", "static", "--master-port", str(free_port()), "--nnodes", "1"]
    command += ["--nproc-per-node", "2", "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]
    command += [str(HERE), "--child", "--workspace", str(workspace), *child_args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    with open(log, "wb") as out:  # a file, not a pipe nobody reads
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--stall-timeout", type=float, default=3.0)
    parser.add_argument("--stall-action", default="record")
    parser.add_argument("--sleep-rank", type=int, default=-1)
    parser.add_argument("--sleep-at", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="the process group's, seconds")
    args = parser.parse_args()
    if not args.child:
        parser.error("run through tests/test_watchdog_distributed.py (torchrun with --child)")
    child(args)


if __name__ == "__main__":
    main()
