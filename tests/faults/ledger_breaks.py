"""A training script for the data ledger's tests (``tests/test_ledger.py``): each launch is one
attempt (a launch that kills itself runs in its own process, the others may run in the test's);
breaks of exactly-once data are planted on purpose.

    python tests/faults/ledger_breaks.py WORKSPACE --steps 12 --interval 4 [--kill-at 10 | --signal-at 3]
        [--plant other-position:4] [--loader stateful|skipping|forgetful|stalling|drifting] [--load none]
        [--loss-none-at 6] [--non-finite-at 7] [--fp16] [--accumulation 3 --max-epochs 2] [--fail-in-restore]

``--kill-at S``: the first launch SIGKILLs itself in step S's forward (a node lost).
``--fail-at S``: the first launch's step S raises (the attempt fails, its steps since the last
save lost). ``--signal-at S``: the first launch sends itself SIGUSR1 as step S begins: it saves at the end of
step S and exits 138 (preempted: the normal requeue path, no kill).
``--plant other-position:K``: the resume restores the data position of checkpoint K instead of
the one it loads (a user's ``load_state_dict`` that mixes up two checkpoints).
``--loader skipping``: a loader with its own ``state_dict`` whose ``load_state_dict`` lands one
batch past the saved position, while saying it resumed there (``stateful``: the same, correct;
``forgetful``: its ``load_state_dict`` does nothing, so it starts the epoch again; ``stalling``: correct,
but the first launch's draw after ``--signal-at``'s save takes 3 s, longer than the exit waits for it).
``--loader drifting``: a list's batches in order in the first epoch a launch draws, rotated by the
launch's attempt + 1 in later ones: an order that depends on something a resume does not restore.
``--loss-none-at S``: step S's first forward returns ``loss=None`` (that micro-batch is drawn, not
trained). ``--non-finite-at S[,S...]``: each such step's first try has a non-finite loss (one retry
allowed: its micro-batch is drawn, not trained, and the step runs again on the next; with ``--fp16``
the grad scaler, made with a scale of 1 so that nothing else overflows, skips those steps instead).
``--accumulation A --max-epochs E``: micro-batches per step, and the data runs out after E epochs
(a last step short of A micro-batches is dropped).
``--fail-in-restore``: a resume fails as RESTORE positions the data (the loader raises when it is
iterated), after the ``restore`` event and before ``data_resumed``: the attempt drew nothing.
``--load none``: ``CheckpointingHook(load=None)``, a fresh start on purpose.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainfsm import BaseTrainer, CheckpointingHook
from trainfsm.checkpoint import CheckpointStore

BATCHES = 10  # per epoch


def batch(index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(4, 3, generator=generator)
    return {"x": x, "y": x.sum(1, keepdim=True)}


class StatefulLoader:
    """Batches 0..BATCHES-1 per epoch, with its own position (``state_dict``): trainfsm resumes
    it by ``load_state_dict`` (``data_resume="state"``). ``skip``: one batch too far on load."""

    def __init__(self, kind: str, stall_at: int = -1) -> None:
        self.kind, self.stall_at = kind, stall_at
        self.position = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while self.position < BATCHES:
            self.position += 1
            if self.position - 1 == self.stall_at:  # the draw after the signalled step's save
                self.stall_at = -1
                time.sleep(3.0)
            yield batch(self.position - 1)
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.kind != "forgetful":
            self.position = state["position"] + (1 if self.kind == "skipping" else 0)


class DriftingLoader:
    """Batches 0..BATCHES-1 in order in the first pass, rotated by ``attempt + 1`` in later ones."""

    def __init__(self, attempt: int) -> None:
        self.attempt = attempt
        self.passes = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        shift = 0 if self.passes == 0 else self.attempt + 1
        self.passes += 1
        return (batch((index + shift) % BATCHES) for index in range(BATCHES))


class FailingOnResume:
    """A list's batches; once ``failing`` (set as a checkpoint loads), iterating it raises."""

    def __init__(self) -> None:
        self.failing = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.failing:
            raise RuntimeError("the data is not there (planted: --fail-in-restore)")
        return (batch(i) for i in range(BATCHES))


class Trainer(BaseTrainer):
    def __init__(self, args: argparse.Namespace, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.args = args
        self.tried: set[int] = set()  # steps whose first forward ran

    def build_data_loader(self) -> Any:
        if self.args.fail_in_restore:
            return FailingOnResume()
        if self.args.loader == "list":
            return [batch(i) for i in range(BATCHES)]
        if self.args.loader == "drifting":
            return DriftingLoader(self.attempt)
        stall_at = self.args.signal_at if self.args.loader == "stalling" else -1
        return StatefulLoader(self.args.loader, stall_at)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(3, 1)

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=1.0, enabled=self.args.fp16)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.05)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        load = None if self.args.load == "none" else "latest"
        return [CheckpointingHook(interval=self.args.interval, keep_previous=10, load=load)]

    def forward(self, input: Any) -> Any:
        if self.step == self.args.kill_at and not (self.workspace / "killed").exists():  # type: ignore[operator]
            (self.workspace / "killed").touch()  # type: ignore[operator]
            os.kill(os.getpid(), signal.SIGKILL)
        if self.step == self.args.fail_at and not (self.workspace / "failed").exists():  # type: ignore[operator]
            (self.workspace / "failed").touch()  # type: ignore[operator]
            raise RuntimeError(f"planted: --fail-at {self.step}")
        if self.step == self.args.signal_at and not (self.workspace / "signalled").exists():  # type: ignore[operator]
            (self.workspace / "signalled").touch()  # type: ignore[operator]
            os.kill(os.getpid(), signal.SIGUSR1)  # taken at the step's end: saved, then exit 138
        loss = nn.functional.mse_loss(self.model(input["x"]), input["y"])  # type: ignore[misc]
        first_try = self.step not in self.tried
        self.tried.add(self.step)
        if self.step == self.args.loss_none_at and first_try:
            return None, {}
        if self.step in self.args.non_finite_at and first_try:
            return loss * float("nan"), {}
        return loss, {}

    def load_state_dict(self, state: dict[str, Any], options: Any = None, data_resume: str = "auto") -> None:
        if self.args.fail_in_restore:
            self.data_loader.failing = True  # type: ignore[union-attr]
        if self.args.plant and self.args.plant.startswith("other-position:"):
            other = self.workspace / "checkpoints" / self.args.plant.split(":")[1]  # type: ignore[operator]
            parts = CheckpointStore.load(other)
            state["rank_state"]["data"] = parts["training_state"]["ranks"][0]["data"]
        super().load_state_dict(state, options, data_resume)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workspace", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--fail-at", type=int, default=-1)
    parser.add_argument("--loss-none-at", type=int, default=-1)
    parser.add_argument("--non-finite-at", type=lambda text: [int(s) for s in text.split(",")], default=[])
    parser.add_argument("--fail-in-restore", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--plant", default="")
    parser.add_argument(
        "--loader", choices=("list", "stateful", "skipping", "forgetful", "stalling", "drifting"), default="list"
    )
    parser.add_argument("--load", choices=("latest", "none"), default="latest")
    args = parser.parse_args(argv)
    Trainer(
        args,
        max_steps=args.steps,
        workspace=args.workspace,
        device="cpu",
        max_non_finite_grad_retries=1 if args.non_finite_at and not args.fp16 else 0,
        mixed_precision="fp16" if args.fp16 else None,
        gradient_accumulation_steps=args.accumulation,
        max_epochs=args.max_epochs,
    ).train()


if __name__ == "__main__":
    main()
