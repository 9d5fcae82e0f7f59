"""One rank of the review's DDP bucket-layout cases (issue 48): DDP configurations the primed
resume of ``trainfsm.ddp_buckets`` must also handle, each trained straight through and, in another
workspace, stopped and resumed by a new trainer with a new DDP (``tests/distributed/buckets_worker.py``'s
pattern), in one launch of 3 ranks.

    python tests/distributed/buckets_review_worker.py review --out DIR --cases a,b   (under launch.py)

Each case's result says whether the resumed run ended with the straight run's parameters bit for
bit, or the exception the resumed run raised, and the DDPBucketsWarnings it gave.

``tests/test_ddp_buckets_review.py`` runs the cases that fail on main at 867d9bd. The others were run
by hand in the review (each bit-exact on main at 3 ranks, and each differs with the priming switched
off: ``BUCKETS_REVIEW_NO_PRIME=1``), e.g.::

    from tests.distributed.launch import run_worker
    run_worker("review", out, 400, "--cases", "retry_at_step_1", world=3, worker=WORKER)
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.buckets_worker import BATCH, FEATURES, OUTPUTS, WIDTH, wide
from tests.distributed.worker import parser, serve

STRAIGHT = 8


class WithSpare(nn.Module):
    """``wide()`` and a layer that forward never uses: what ``static_graph=True`` exists for."""

    def __init__(self) -> None:
        super().__init__()
        self.body = wide()
        self.spare = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


class Conv(nn.Module):
    """A small convolutional model in ``channels_last`` (what GPU users train convolutions in)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(FEATURES // 4, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], FEATURES // 4, 2, 2).contiguous(memory_format=torch.channels_last)
        x = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))  # type: ignore[no-any-return]


def channels_last() -> nn.Module:
    return Conv().to(memory_format=torch.channels_last)


def mixed() -> nn.Module:
    """``wide()`` with its third layer in float64: DDP buckets each dtype apart."""
    model = wide()
    model[2].double()

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self.seq
            x = s[1](s[0](x))
            x = s[3](s[2](x.double())).float()
            return s[6](s[5](s[4](x)))  # type: ignore[no-any-return]

    return Mixed()


def frozen_first() -> nn.Module:
    model = wide()
    model[0].requires_grad_(False)  # frozen in both runs
    return model


def batches(rank: int, poison: str | None, n: int = 64) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """The rank's batches; the first is marked ``poison`` ("nan": a non-finite gradient, "none":
    forward returns loss=None)."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(n):
        x, y = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUTPUTS, generator=g)
        out.append((x, y, poison if (i == 0 and poison) else ""))
    return out


@dataclass
class Case:
    model: Callable[[], nn.Module] = wide
    ddp: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallel's arguments
    resumed_ddp: dict[str, Any] | None = None  # the resumed run's, when they differ
    options: dict[str, Any] = field(default_factory=dict)  # the trainer's
    stops: tuple[int, ...] = (4,)  # the steps each attempt but the last stops at
    poison: str | None = None
    comm_hook: str | None = None
    compiled: bool = False
    nest: bool = False  # the DDP inside another module (GAN-style or an EMA wrapper)


CASES: dict[str, Case] = {
    # Briefed cases that should be exact.
    "retry_at_step_1": Case(poison="nan", options={"max_non_finite_grad_retries": 2}, stops=(2,)),
    "loss_none_first_micro": Case(
        poison="none",
        options={"gradient_accumulation_steps": 2, "no_sync_accumulate": False, "loss_none_agreement": True},
        stops=(1,),
    ),
    "accumulate_without_no_sync": Case(options={"gradient_accumulation_steps": 2, "no_sync_accumulate": False}),
    "second_resume": Case(stops=(3, 5)),
    "static_graph_second_resume": Case(ddp={"static_graph": True}, stops=(1, 2)),
    "frozen_in_both": Case(model=frozen_first),
    "mixed_dtypes": Case(model=mixed),
    "fp16_comm_hook": Case(comm_hook="fp16"),
    "compiled": Case(compiled=True),
    # Suspected defects.
    "static_graph_unused_after_one_step": Case(model=WithSpare, ddp={"static_graph": True}, stops=(1,)),
    "static_graph_unused": Case(model=WithSpare, ddp={"static_graph": True}, stops=(4,)),
    "nested_ddp": Case(nest=True),
    # Saved by a run that followed the guide's advice (find_unused_parameters=True), resumed without it.
    "advice_then_default": Case(ddp={"find_unused_parameters": True}, resumed_ddp={}),
    # The guide says each configuration differs with the priming switched off: the controls
    # (run with BUCKETS_REVIEW_NO_PRIME=1) of the configurations tests/test_ddp_buckets.py covers.
    "after_one_step": Case(stops=(1,)),
    "no_sync": Case(options={"gradient_accumulation_steps": 2, "no_sync_accumulate": True}),
    "static_graph": Case(ddp={"static_graph": True}),
    "static_graph_after_one_step": Case(ddp={"static_graph": True}, stops=(1,)),
    "gradient_as_bucket_view": Case(ddp={"gradient_as_bucket_view": True}),
    "channels_last": Case(model=channels_last, stops=(2,)),
    "bucket_cap_changed": Case(ddp={"bucket_cap_mb": 25}, resumed_ddp={"bucket_cap_mb": 1}),
}


def make(case: Case, workspace: Path, steps: int, resumed: bool) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    from trainfsm import BaseTrainer, CheckpointingHook

    rank = int(os.environ["RANK"])
    kwargs = case.resumed_ddp if (resumed and case.resumed_ddp is not None) else case.ddp

    class Trainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            return batches(rank, case.poison)

        def build_model(self) -> nn.Module:
            ddp = DistributedDataParallel(case.model(), **kwargs)
            if case.comm_hook == "fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            if case.nest:
                return nn.Sequential(ddp)
            if case.compiled:
                return torch.compile(ddp, backend="aot_eager")  # type: ignore[return-value]
            return ddp

        def build_optimizer(self) -> torch.optim.Optimizer:
            named = self.model.named_parameters()  # type: ignore[union-attr]
            # The spare layer never has a gradient, so never an optimizer state: kept out of it.
            params = [p for n, p in named if p.requires_grad and "spare" not in n]
            return torch.optim.Adam(params, lr=1e-3)

        def build_hooks(self) -> list[Any]:
            return [CheckpointingHook(interval=1000, keep_previous=1)]

        def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
            x, y, poison = input
            if poison == "nan":
                x = x * float("nan")
            out = self.model(x)  # type: ignore[misc]
            if poison == "none":
                return None, {}
            return nn.functional.mse_loss(out, y), {}

    return Trainer(max_steps=steps, workspace=workspace, device="cpu", **case.options)


def params(run: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.unwrapped_model.parameters()]


def one(out: Path, name: str) -> dict[str, Any]:
    from trainfsm import ddp_buckets

    case = CASES[name]
    if os.environ.get("BUCKETS_REVIEW_NO_PRIME") == "1":  # the control: what a resume was before issue 48
        ddp_buckets.BucketOrder.prime = lambda self, saved: {"passes": 0, "fingerprint": None}  # type: ignore[method-assign]
    straight = make(case, out / name / "straight", STRAIGHT, False)
    straight.train()
    result: dict[str, Any] = {"straight": params(straight), "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for number, stop in enumerate(case.stops):
                make(case, out / name / "resumed", stop, number > 0).train()
            resumed = make(case, out / name / "resumed", STRAIGHT, True)
            resumed.train()
            result["resumed"] = params(resumed)
            result["steps"] = resumed.step
            result["hooks_left"] = sum(
                len(p._post_accumulate_grad_hooks or {}) for p in resumed.unwrapped_model.parameters()
            )
        except Exception:
            result["error"] = traceback.format_exc(limit=4)
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ddp_buckets.DDPBucketsWarning)]
    return result


def scenario_review(out: Path, cases: list[str]) -> dict[str, Any]:
    return {name: one(out, name) for name in cases}


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--cases", default=",".join(CASES))
    args = arguments.parse_args()
    serve({"review": lambda a, rank: scenario_review(a.out, args.cases.split(","))}, args, "buckets_review_worker.py")


if __name__ == "__main__":
    main()
