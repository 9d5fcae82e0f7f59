"""One rank of the DDP bucket-layout scenarios (``tests/test_ddp_buckets.py``): several DDP
configurations, each trained straight through and, in another workspace, stopped and resumed by
a new trainer with a new DDP (what a new process gets), in one launch of 3 or 4 ranks.

    python tests/distributed/buckets_worker.py buckets --out DIR   (under tests/distributed/launch.py)

The model has 4.8 MB of parameters: DDP's rebuilt layout has two buckets (the first capped at
1 MiB), where its first layout has one.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.worker import parser, serve

WIDTH, FEATURES, OUTPUTS, BATCH = 768, 32, 8, 8
STRAIGHT, STOP = 8, 4  # steps of the straight run; the resumed runs stop at STOP unless told


def wide(frozen: bool = False) -> nn.Module:
    """``frozen``: the first layer does not train (the resumed run's model differs from the saved one's
    in its trainable parameters, though not in its state dict)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUTPUTS),
    )  # fmt: skip
    if frozen:
        model[0].requires_grad_(False)
    return model


def batches(rank: int, n: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUTPUTS, generator=g)) for _ in range(n)]


def trainer(
    workspace: Path, steps: int, wrap: Callable[[nn.Module], nn.Module], frozen: bool = False, **kw: Any
) -> Any:
    from trainfsm import BaseTrainer, CheckpointingHook

    rank = int(os.environ["RANK"])

    class Trainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            return batches(rank)

        def build_model(self) -> nn.Module:
            return wrap(wide(frozen))

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]

        def build_hooks(self) -> list[Any]:
            return [CheckpointingHook(interval=1000, keep_previous=1)]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    return Trainer(max_steps=steps, workspace=workspace, device="cpu", **kw)


def params(run: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.unwrapped_model.parameters()]


def ddp(**kw: Any) -> Callable[[nn.Module], nn.Module]:
    from torch.nn.parallel import DistributedDataParallel

    return lambda model: DistributedDataParallel(model, **kw)


def wrapped(model: nn.Module) -> nn.Module:
    from trainfsm.distributed import wrap_model

    return wrap_model(model, "ddp")


#: name -> (wrap, trainer options, the step the first run stops at, the resumed model frozen)
CASES: dict[str, tuple[Callable[[nn.Module], nn.Module], dict[str, Any], int, bool]] = {
    "default": (ddp(), {}, STOP, False),
    "after_one_step": (ddp(), {}, 1, False),
    "wrap_model": (wrapped, {}, STOP, False),
    "no_sync": (ddp(), {"gradient_accumulation_steps": 2, "no_sync_accumulate": True}, STOP, False),
    "static_graph": (ddp(static_graph=True), {}, STOP, False),
    "static_graph_after_one_step": (ddp(static_graph=True), {}, 1, False),
    "gradient_as_bucket_view": (ddp(gradient_as_bucket_view=True), {}, STOP, False),
    "not_primed": (ddp(), {}, STOP, False),  # the control: priming switched off, the resume differs
    "model_changed": (ddp(), {}, STOP, True),
}


def scenario_buckets(out: Path, rank: int, cases: list[str]) -> dict[str, Any]:
    from trainfsm import ddp_buckets

    result: dict[str, Any] = {}
    for name in cases:
        wrap, options, stop, frozen = CASES[name]
        straight = trainer(out / name / "straight", STRAIGHT, wrap, **options)
        straight.train()
        trainer(out / name / "resumed", stop, wrap, **options).train()
        prime = ddp_buckets.BucketOrder.prime
        if name == "not_primed":  # what a resume was before trainfsm.ddp_buckets
            ddp_buckets.BucketOrder.prime = lambda self, saved: {"passes": 0, "fingerprint": None}  # type: ignore[method-assign]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                resumed = trainer(out / name / "resumed", STRAIGHT, wrap, frozen, **options)
                resumed.train()
        finally:
            ddp_buckets.BucketOrder.prime = prime  # type: ignore[method-assign]
        result[name] = {
            "straight": params(straight),
            "resumed": params(resumed),
            "steps": resumed.step,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, ddp_buckets.DDPBucketsWarning)],
        }
    return result


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--cases", default=",".join(CASES))
    args = arguments.parse_args()
    cases = args.cases.split(",")
    serve({"buckets": lambda a, rank: scenario_buckets(a.out, rank, cases)}, args, "buckets_worker.py")


if __name__ == "__main__":
    main()
