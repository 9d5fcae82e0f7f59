"""Record the real trails the ledger's tests across world sizes read (``tests/test_ledger_sizes.py``).

    python tests/faults/reshard_trails.py          # rewrites tests/data/reshard/{clean,planted}/logs

Each is a run of ``tests/distributed/reshard_worker.py`` (100 samples, ``DistributedSampler`` with
shuffle, per-rank batches of 2, ``global_batch_size=24``), its ranks started as processes of their
own (``tests.distributed.launch.Ranks``, gloo, each signalling itself):

- ``clean``: preempted (SIGUSR1) at 4 ranks in step 2, resumed at 2 and preempted in step 6,
  resumed at 3 to step 8: every sample of both epochs once;
- ``planted``: preempted at 4 ranks in step 2, resumed at 2 with ``--plant rank0`` (every new rank
  resumes old rank 0's own position: trainfsm before issue 49) to step 8.

The workspace's path in the trails is replaced by ``runs/reshard``, so they read the same anywhere.
About 30 s on 2 cores. Record again when the trail's format changes (a slow test of
``tests/test_ledger_sizes.py`` records both anew and checks the ledger says the same of them).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import ROOT, Ranks

DATA = ROOT / "tests" / "data" / "reshard"
WORKER = ROOT / "tests" / "distributed" / "reshard_worker.py"
PLANS = {
    "clean": [(4, ["--preempt-at", "2"]), (2, ["--preempt-at", "6"]), (3, [])],
    "planted": [(4, ["--preempt-at", "2"]), (2, ["--plant", "rank0"])],
}


def record(name: str, workspace: Path) -> Path:
    """Run ``name``'s plan in ``workspace``; returns its logs directory (paths as they are)."""
    for world, extra in PLANS[name]:
        argv = [sys.executable, str(WORKER), "--workspace", str(workspace), "--self-signal", *extra]
        with Ranks(lambda rank, argv=argv: argv, workspace.parent / f"stderr-{name}-{world}", world=world) as started:
            outcome = started.wait(240)
        if outcome.hung or any(code not in (0, 138) for code in outcome.codes.values()):
            raise RuntimeError(f"{name} at {world} ranks: {outcome.describe()}")
    return workspace / "logs"


def main() -> None:
    for name in PLANS:
        with tempfile.TemporaryDirectory() as scratch:
            workspace = Path(scratch) / "ws"
            logs = record(name, workspace)
            target = DATA / name / "logs"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            for trail in sorted(logs.glob("events.rank*.jsonl")):
                (target / trail.name).write_text(trail.read_text().replace(str(workspace), "runs/reshard"))
        print(f"recorded {target}")


if __name__ == "__main__":
    main()
