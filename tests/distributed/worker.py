"""One rank of a distributed test scenario; ``tests/distributed/launch.py`` starts one per rank.

    python tests/distributed/worker.py SCENARIO --out DIR [--pg-timeout 20]

The process group comes from torchrun's variables through ``trainfsm.distributed.init_distributed``
with a short timeout, so a rank whose peer is gone fails instead of hanging. Each scenario writes
what the test checks to ``DIR/SCENARIO.rank{R}.pt`` and its audit trails under ``DIR/<run>/logs``.
Data, models and the single-process reference are module functions, so the test computes the
expected result in its own process from the same definitions.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

BATCH = 4
IN, HIDDEN, OUT = 4, 8, 2


def batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``index``-th micro-batch: fixed by the seed, whatever the process."""
    g = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def mlp(seed: int = 0, norm: bool = False) -> nn.Module:
    """``norm``: a BatchNorm layer, whose running statistics are buffers DDP broadcasts in forward."""
    torch.manual_seed(seed)
    middle = [nn.BatchNorm1d(HIDDEN)] if norm else []
    return nn.Sequential(nn.Linear(IN, HIDDEN), *middle, nn.Tanh(), nn.Linear(HIDDEN, OUT))


def reference(
    steps: int, accumulation: int, world: int, lr: float, skipped: frozenset[int] = frozenset()
) -> list[torch.Tensor]:
    """One process, plain SGD, each step on the concatenation of every rank's micro-batches.
    ``skipped``: batch indices no rank trains on (every rank skipped them: loss=None somewhere).
    Runs in the test's own process: the global random state is left as it was."""
    with torch.random.fork_rng():
        model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    used = [i for i in range(steps * accumulation + len(skipped)) if i not in skipped]
    for step in range(steps):
        indices = used[step * accumulation : (step + 1) * accumulation]
        parts = [batch(i, r) for i in indices for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a DTensor (FSDP2): gather the whole tensor
    return (full() if full is not None else tensor).detach().clone()


def _describe(value: Any) -> Any:
    """(type, global shape, local shape) of a tensor; nested containers described likewise."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "to_local", None)
        return (type(value).__name__, tuple(value.shape), tuple((local() if local else value).shape))
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return type(value).__name__


def make_trainer(**kwargs: Any) -> Any:
    from trainfsm import BaseTrainer

    class Trainer(BaseTrainer):
        """Scripted per forward call (1-based, this rank only): "nan" multiplies the loss by NaN,
        "nan_row" makes only output unit 7's gradient NaN, "none" returns loss=None without calling
        the model, "none_after_forward" calls the model and then returns None, "raise" raises."""

        def __init__(
            self,
            *,
            model: Callable[[], nn.Module],
            data_seed: int = 0,
            optimizer: str = "sgd",
            lr: float = 0.1,
            script: Mapping[int, str] | None = None,
            hooks: Sequence[Any] = (),
            n_batches: int = 64,
            **kw: Any,
        ) -> None:
            kw.setdefault("device", "cpu")
            super().__init__(**kw)
            rank = int(os.environ.get("RANK", "0"))
            self.batches = [batch(i + data_seed, rank) for i in range(n_batches)]
            self.model_factory, self.optimizer_name, self.lr = model, optimizer, lr
            self.script, self.hook_list, self.calls = dict(script or {}), list(hooks), 0

        def build_data_loader(self) -> Any:
            return self.batches

        def build_model(self) -> nn.Module:
            return self.model_factory()

        def build_optimizer(self) -> torch.optim.Optimizer:
            assert self.model is not None
            if self.optimizer_name == "adam":
                return torch.optim.Adam(self.model.parameters(), lr=self.lr)
            return torch.optim.SGD(self.model.parameters(), lr=self.lr)

        def build_hooks(self) -> list[Any]:
            return self.hook_list

        def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
            assert self.model is not None
            self.calls += 1
            action = self.script.get(self.calls)
            if action == "raise":
                raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
            if action == "none":
                return None, {}
            x, y = input
            out = self.model(x)
            if action == "none_after_forward":
                return None, {}
            if action == "nan_row":  # NaN reaches only row 7 of the weight and bias[7]
                mask = torch.zeros(out.shape[1])
                mask[7] = float("nan")
                return out.pow(2).mean() + (out * mask).sum(), {}
            # A model with another output width than the targets (fsdp_nan's) regresses to zero.
            loss = nn.functional.mse_loss(out, y) if out.shape == y.shape else out.pow(2).mean()
            if action == "nan":
                loss = loss * float("nan")
            return loss, {}

    return Trainer(**kwargs)


def ddp(model: nn.Module, counter: list[int] | None = None) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model)
    if counter is not None:  # count the gradient all-reduces that DDP actually runs

        def counting(state, bucket):  # type: ignore[no-untyped-def] # DDP rejects non-GradBucket annotations
            counter[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        wrapped.register_comm_hook(None, counting)
    return wrapped


def fsdp_mlp(seed: int = 0) -> nn.Module:
    """``mlp`` with ``fully_shard`` (FSDP2) on each Linear and on the root."""
    from torch.distributed.fsdp import fully_shard

    model = mlp(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)  # type: ignore[no-any-return]


def _params(trainer: Any) -> list[torch.Tensor]:
    return [_full(p) for p in trainer.unwrapped_model.parameters()]


# ---------------------------------------------------------------- scenarios
def scenario_ddp(out: Path, rank: int) -> dict[str, Any]:
    """Accumulation over 3 micro-batches with and without no_sync; loss=None on a DDP model."""
    result: dict[str, Any] = {}
    for label, no_sync in (("no_sync", True), ("sync_every_micro_batch", False)):
        counter = [0]
        trainer = make_trainer(
            model=lambda c=counter: ddp(mlp(), c),  # type: ignore[misc]
            max_steps=4,
            gradient_accumulation_steps=3,
            no_sync_accumulate=no_sync,
            workspace=out / label,
        )
        trainer.train()
        result[label] = {"params": _params(trainer), "allreduces": counter[0]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(model=lambda: ddp(mlp()), max_steps=2, script={2: "none"}, workspace=out / "loss_none")
        trainer.train()
    result["loss_none"] = {
        "warnings": [(w.category.__name__, str(w.message), Path(w.filename).name) for w in caught],
        "params": _params(trainer),
    }
    return result


def scenario_fsdp(out: Path, rank: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import FullyShardedDataParallel

    from trainfsm.utils import map_nested_tensor

    result: dict[str, Any] = {}
    try:  # the older wrapper: kept by torch, but does it run on CPU with gloo?
        FullyShardedDataParallel(mlp())
        result["fsdp1"] = "ok"
    except Exception as exc:
        result["fsdp1"] = f"{type(exc).__name__}: {exc}"

    sharded = fsdp_mlp
    # Training: 3 steps of 2 micro-batches, against the one-process reference.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(model=sharded, max_steps=3, gradient_accumulation_steps=2, workspace=out / "train")
        trainer.train()
        result["train"] = {
            "params": _params(trainer),
            "grad_types": sorted({type(p).__name__ for p in trainer.model.parameters()}),
        }
        loss_none = make_trainer(model=sharded, max_steps=2, script={2: "none"}, workspace=out / "loss_none")
        loss_none.train()
    result["loss_none_warnings"] = [w.category.__name__ for w in caught]

    # state_dict()/load_state_dict() under each options value, and a round trip into another model.
    for label, options in (
        ("default", None),
        ("sharded", StateDictOptions(full_state_dict=False)),
        ("full", StateDictOptions(full_state_dict=True)),
    ):
        a = make_trainer(model=sharded, optimizer="adam", lr=0.01, max_steps=2, state_dict_options=options)
        a.train()
        state = map_nested_tensor(lambda t: t.detach().clone(), a.state_dict())
        # Described now: set_state_dict replaces full tensors in the dict it is given by shards.
        described = {"model": _describe(state["model"]), "optimizer_state": _describe(state["optimizer"]["state"])}
        b = make_trainer(
            model=lambda: sharded(seed=1), data_seed=50, optimizer="adam", lr=0.01, max_steps=1,
            state_dict_options=options,
        )  # fmt: skip
        b.train()
        before = _params(b)
        b.load_state_dict(state)
        a_optim, b_optim = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        result[label] = {
            **described,
            "a_params": _params(a),
            "b_before": before,
            "b_after": _params(b),
            "optim_equal": all(
                torch.equal(_full(a_optim[k][name]), _full(b_optim[k][name]))
                for k in a_optim
                for name in ("exp_avg", "exp_avg_sq")
            ),
            "step": b.step,
        }

    result["checkpoint"] = _fsdp_checkpoint(out)  # last: one of its cases fails (symmetrically) today
    return result


def _fsdp_checkpoint(out: Path) -> dict[str, Any]:
    """CheckpointingHook with FSDP2: save at step 3, then a differently initialised run resumes.
    Each case records the resumed parameters against the saved ones, or the error of each run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from trainfsm import CheckpointingHook

    result: dict[str, Any] = {}
    for label, options, optimizer in (
        ("full_adam", StateDictOptions(full_state_dict=True), "adam"),
        ("default_adam", None, "adam"),  # sharded state: every rank writes its shards (DCP)
        ("full_sgd", StateDictOptions(full_state_dict=True), "sgd"),  # an optimizer without state
        ("default_sgd", None, "sgd"),  # sharded, without optimizer state: saved and loaded with no step
        # Rank 0 alone holds the full state (in CPU memory). Last: today rank 1 fails alone in RESTORE.
        ("full_offload_adam", StateDictOptions(full_state_dict=True, cpu_offload=True), "adam"),
    ):
        runs: dict[str, Any] = {}
        for run, seed in (("first", 0), ("resumed", 1)):
            trainer = make_trainer(
                model=lambda s=seed: fsdp_mlp(s), optimizer=optimizer, lr=0.01, max_steps=3,  # type: ignore[misc]
                state_dict_options=options, workspace=out / label, hooks=[CheckpointingHook(interval=3)],
            )  # fmt: skip
            try:
                trainer.train()
                runs[run] = {"params": _params(trainer), "step": trainer.step, "error": None}
            except Exception as exc:
                runs[run] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
                break
        result[label] = runs
    return result


def scenario_fsdp_nan(out: Path, rank: int) -> dict[str, Any]:
    """FSDP2 on one Linear(4, 8): rows 0-3 live on rank 0, rows 4-7 on rank 1. At step 2 only
    output unit 7's gradient is NaN, so only rank 1's gradient shard is non-finite. First with
    grad_clip (workspace ``clip``), then without (``no_clip``; last, as the ranks may diverge)."""
    from torch.distributed.fsdp import fully_shard

    def sharded() -> nn.Module:
        torch.manual_seed(0)
        return fully_shard(nn.Linear(IN, HIDDEN))  # type: ignore[no-any-return]

    for label, grad_clip in (("clip", 100.0), ("no_clip", None)):
        trainer = make_trainer(
            model=sharded, max_steps=3, max_non_finite_grad_retries=2, grad_clip=grad_clip,
            script={2: "nan_row"}, workspace=out / label,
        )  # fmt: skip
        trainer.train()
    return {}


def scenario_ddp_faults(out: Path, rank: int) -> dict[str, Any]:
    """DDP, runs that both ranks finish: ``nan``: rank 1's loss is NaN on its 2nd forward, a
    checkpoint every 2 steps; with 2 micro-batches a step, forward call 3 (step 2, micro-batch 0)
    returns loss=None after calling the model: on rank 1 only (``loss_none``), on both ranks
    (``loss_none_everywhere``)."""
    from trainfsm import CheckpointingHook

    trainer = make_trainer(
        model=lambda: ddp(mlp()), max_steps=5, max_non_finite_grad_retries=2,
        script={2: "nan"} if rank == 1 else {}, workspace=out / "nan", hooks=[CheckpointingHook(interval=2)],
    )  # fmt: skip
    trainer.train()
    return {
        "nan": {"params": _params(trainer)},
        **{
            label: scenario_one_rank(
                out / label,
                rank,
                "none_after_forward",
                at=LOSS_NONE_AT,
                accumulation=2,
                every_rank=every_rank,
                agree=True,
            )
            for label, every_rank in (("loss_none", False), ("loss_none_everywhere", True))
        },
    }


LOSS_NONE_AT = 3  # forward call (1-based): step 2's first micro-batch with 2 micro-batches a step


def scenario_one_rank(
    out: Path,
    rank: int,
    action: str,
    norm: bool = False,
    linger: float = 0.0,
    at: int = 2,
    accumulation: int = 1,
    every_rank: bool = False,
    agree: bool = False,
    interval: int = 0,
) -> dict[str, Any]:
    """DDP, 4 steps; on rank 1 only (or on ``every_rank``), forward call ``at`` does ``action``.
    ``linger``: rank 1 catches its own failure and stays alive that long, without leaving the group.
    ``agree``: ``loss_none_agreement=True``; ``interval``: a CheckpointingHook saving that often."""
    from trainfsm import CheckpointingHook

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(
            model=lambda: ddp(mlp(norm=norm)), max_steps=4, script={at: action} if rank == 1 or every_rank else {},
            gradient_accumulation_steps=accumulation, workspace=out / "run", loss_none_agreement=agree,
            hooks=[CheckpointingHook(interval=interval)] if interval else [],
        )  # fmt: skip
        try:
            trainer.train()
        except Exception:
            if linger and rank == 1:
                time.sleep(linger)
            raise
    return {"params": _params(trainer), "warnings": [w.category.__name__ for w in caught]}


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every worker takes: the scenario, where to write, the group's timeout, an action."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("scenario")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pg-timeout", type=float, default=20.0)
    parser.add_argument("--action", default="none")
    return parser


Scenario = Callable[[argparse.Namespace, int], dict[str, Any]]


def serve(scenarios: Mapping[str, Scenario], args: argparse.Namespace, name: str) -> None:
    """Join the group, run ``args.scenario`` on this rank, save what it returns, leave together."""
    torch.set_num_threads(1)
    from trainfsm.distributed import cleanup_distributed, init_distributed

    layout = init_distributed(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    if layout is None:
        sys.exit(f"{name} runs under tests/distributed/launch.py (or torchrun), which set RANK and WORLD_SIZE")
    try:
        scenario = scenarios.get(args.scenario)
        if scenario is None:
            raise SystemExit(f"unknown scenario {args.scenario!r}; one of {', '.join(scenarios)}")
        result = scenario(args, layout.rank)
        torch.save(result, args.out / f"{args.scenario}.rank{layout.rank}.pt")
        # Both ranks reach the teardown together: a rank that destroys its gloo group while the
        # other is still closing its pairs can be aborted by gloo (exit -6) after a clean run.
        import torch.distributed as dist

        dist.barrier()
    finally:
        cleanup_distributed()


SCENARIOS: dict[str, Scenario] = {
    "ddp": lambda args, rank: scenario_ddp(args.out, rank),
    "fsdp": lambda args, rank: scenario_fsdp(args.out, rank),
    "fsdp_nan": lambda args, rank: scenario_fsdp_nan(args.out, rank),
    "ddp_faults": lambda args, rank: scenario_ddp_faults(args.out, rank),
    "one_rank": lambda args, rank: scenario_one_rank(
        args.out, rank, args.action, args.norm, args.linger, agree=args.agree, interval=args.interval
    ),
}


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--norm", action="store_true")
    arguments.add_argument("--linger", type=float, default=0.0)
    arguments.add_argument("--agree", action="store_true", help="loss_none_agreement=True")
    arguments.add_argument("--interval", type=int, default=0, help="checkpoint every N steps (0: no hook)")
    serve(SCENARIOS, arguments.parse_args(), "worker.py")


if __name__ == "__main__":
    main()
