"""One rank of the out-of-memory scenario with DDP (``tests/test_oom.py``): batches of 64 on every
rank, and rank 1's forward runs out of memory above 16 rows (rank 0's never does); then a reference
run given micro-batches of 16 and 4 times the accumulation from the start, in another workspace.

    python tests/distributed/oom_worker.py oom --out DIR   (under tests/distributed/launch.py)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.worker import parser, serve
from tests.oom_trainer import FitsUpTo, batches, quartered

STEPS = 5


class Counted:
    """DDP with a communication hook that counts its gradient all-reduces (one per bucket)."""

    def __init__(self) -> None:
        self.all_reduces = 0

    def __call__(self, module: nn.Module) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        def counted(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks a real GradBucket annotation
            self.all_reduces += 1
            return allreduce_hook(state, bucket)

        ddp = DistributedDataParallel(module)
        ddp.register_comm_hook(None, counted)
        return ddp


def scenario_oom(out: Path, rank: int) -> dict[str, Any]:
    split_ddp, reference_ddp = Counted(), Counted()
    data = batches(STEPS, 64, seed=rank)
    split = FitsUpTo(
        data,
        limit=16 if rank == 1 else None,
        wrap=split_ddp,
        max_steps=STEPS,
        max_oom_retries=3,
        workspace=out / "split",
    )
    split.train()
    reference = FitsUpTo(
        quartered(data), wrap=reference_ddp, max_steps=STEPS, gradient_accumulation_steps=4,
        workspace=out / "reference",
    )  # fmt: skip
    reference.train()
    return {
        "split": [p.detach().clone() for p in split.model.parameters()],  # type: ignore[union-attr]
        "reference": [p.detach().clone() for p in reference.model.parameters()],  # type: ignore[union-attr]
        "rows_seen": split.rows_seen,
        "all_reduces": {"split": split_ddp.all_reduces, "reference": reference_ddp.all_reduces},
    }


def main() -> None:
    args = parser(__doc__).parse_args()
    serve({"oom": lambda a, rank: scenario_oom(a.out, rank)}, args, "oom_worker.py")


if __name__ == "__main__":
    main()
