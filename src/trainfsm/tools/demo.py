"""The demo behind ``trainfsm demo`` / ``make demo``: a small MLP learns scikit-learn's digits on CPU.

The data (1,797 8x8 images of handwritten digits) ships inside scikit-learn, so nothing is
downloaded. 80% trains, 20% is held out for validation. A shuffling ``DataLoader``, Adam and a
``CheckpointingHook`` make it a real run: checkpoints every ``checkpoint_every`` steps and at the
end under ``WORKSPACE/checkpoints``, the audit trail in ``WORKSPACE/logs/events.rank0.jsonl``.

Running it again on the same workspace resumes from the latest checkpoint (the hook's default
``load="latest"``): with a larger ``steps`` it trains on from there; with the same ``steps`` there is
nothing left to do, and it reports the restored model's accuracy.

Library code: it logs through ``logging.getLogger("trainfsm.demo")`` and never configures logging;
the ``trainfsm`` command does (``logging.basicConfig``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainfsm.hooks import BaseHook, CheckpointingHook, LoggingHook
from trainfsm.trainer import BaseTrainer

DEFAULT_WORKSPACE: Final = Path("runs/demo")
DEFAULT_STEPS: Final = 300

log = logging.getLogger("trainfsm.demo")


class DemoError(RuntimeError):
    """The demo cannot run here; the message says what to install or change."""


@dataclass(frozen=True, slots=True)
class DigitsSplit:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


def load_digits_split(seed: int = 0, val_fraction: float = 0.2) -> DigitsSplit:
    """scikit-learn's digits as float tensors in [0, 1], split at random (fixed by ``seed``)."""
    try:
        from sklearn.datasets import load_digits  # optional: the `demo` extra; importing it costs ~1 s
    except ImportError:
        raise DemoError(
            "the demo needs scikit-learn (the digits data ships inside it): "
            "pip install 'trainfsm[demo]'  (or: pip install scikit-learn)"
        ) from None
    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.as_tensor(digits.target, dtype=torch.int64)
    # A private generator: the split is the same on every run and leaves the global RNG alone.
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return DigitsSplit(x[train], y[train], x[val], y[val])


class DigitsTrainer(BaseTrainer):
    """A 64-128-10 MLP on the digits, with checkpointing and a progress line every ``log_every`` steps."""

    def __init__(
        self,
        data: DigitsSplit,
        *,
        hidden: int = 128,
        batch_size: int = 64,
        lr: float = 1e-3,
        checkpoint_every: int = 100,
        keep_previous: int = 1,
        log_every: int = 50,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.data = data
        self.hidden = hidden
        self.batch_size = batch_size
        self.lr = lr
        self.checkpoint_every = checkpoint_every
        self.keep_previous = keep_previous
        self.log_every = log_every

    def build_data_loader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        dataset = TensorDataset(self.data.x_train, self.data.y_train)
        # shuffle draws each epoch's order from torch's global RNG, which checkpoints save and
        # restore: a resumed run draws exactly the batches the interrupted one would have drawn.
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def build_model(self) -> nn.Module:
        features, classes = self.data.x_train.shape[1], 10
        model = nn.Sequential(nn.Linear(features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, classes))
        return model.to(self.device)

    def build_optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None  # built just before, in BUILD
        return torch.optim.Adam(self.model.parameters(), lr=self.lr)

    def build_hooks(self) -> list[BaseHook]:
        return [
            CheckpointingHook(interval=self.checkpoint_every, keep_previous=self.keep_previous),
            LoggingHook(interval=self.log_every),  # its metrics events let `trainfsm plot` draw curves
            DemoProgress(self.log_every),
        ]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = (t.to(self.device) for t in input)
        logits = self.model(x)  # type: ignore[misc]
        loss = nn.functional.cross_entropy(logits, y)
        # A tensor, not .item(): reading it on the host every step would be a sync for nothing.
        return loss, {"accuracy": (logits.detach().argmax(1) == y).float().mean()}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Accuracy on the held-out digits."""
        model = self.unwrapped_model
        was_training = model.training
        model.eval()
        logits = model(self.data.x_val.to(self.device))
        accuracy = (logits.argmax(1) == self.data.y_val.to(self.device)).float().mean().item()
        model.train(was_training)
        return float(accuracy)


class DemoProgress(BaseHook):
    """One line every ``interval`` steps and at the last: loss, batch accuracy, validation accuracy."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.start_step = 0
        self._started = 0.0

    def on_before_train(self, trainer: BaseTrainer) -> None:
        self.start_step = trainer.step
        self._started = time.perf_counter()

    def on_after_step(self, trainer: BaseTrainer) -> None:
        step = trainer.step
        if step % self.interval and step != trainer.max_steps:
            return
        info = trainer.step_info
        # Host reads (syncs on an accelerator): only on the steps that print.
        loss = float(info["loss"][-1])  # the step's micro-batches' losses: one here
        accuracy = float(info["records"][-1]["accuracy"])
        val = trainer.evaluate() if isinstance(trainer, DigitsTrainer) else float("nan")
        rate = (step - self.start_step) / max(time.perf_counter() - self._started, 1e-9)
        log.info(
            "step %4d/%d  loss %.4f  batch acc %.3f  val acc %.3f  (%.0f steps/s)",
            step,
            trainer.max_steps,
            loss,
            accuracy,
            val,
            rate,
        )


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What a demo run did and where it left its files."""

    workspace: Path
    checkpoints: Path
    latest: str | None
    events: Path
    attempt: int
    start_step: int
    step: int
    max_steps: int
    exit_reason: str | None
    val_accuracy: float
    val_size: int
    train_size: int
    seconds: float


def run(
    workspace: Path | str = DEFAULT_WORKSPACE,
    steps: int = DEFAULT_STEPS,
    *,
    log_every: int = 50,
    checkpoint_every: int = 100,
    keep_previous: int = 1,
    seed: int = 0,
) -> DemoResult:
    """Train (or resume) the digits MLP in ``workspace`` up to ``steps`` optimizer steps."""
    started = time.perf_counter()
    data = load_digits_split(seed)
    torch.manual_seed(seed)  # model init and the first epoch's order; a resume restores the saved RNG
    trainer = DigitsTrainer(
        data,
        checkpoint_every=checkpoint_every,
        keep_previous=keep_previous,
        log_every=log_every,
        max_steps=steps,
        workspace=Path(workspace),
        device="cpu",
    )
    trainer.train()
    checkpoint_hook, progress = trainer.hooks[0], trainer.hooks[-1]
    assert isinstance(checkpoint_hook, CheckpointingHook) and isinstance(progress, DemoProgress)
    store = checkpoint_hook.store
    root = store.root if store is not None else Path(workspace) / "checkpoints"
    return DemoResult(
        workspace=Path(workspace),
        checkpoints=root,
        latest=store.latest_name() if store is not None else None,
        events=Path(workspace) / "logs" / f"events.rank{trainer.rank}.jsonl",
        attempt=trainer.attempt,
        start_step=progress.start_step,
        step=trainer.step,
        max_steps=steps,
        exit_reason=trainer.exit_reason,
        val_accuracy=trainer.evaluate(),
        val_size=len(data.y_val),
        train_size=len(data.y_train),
        seconds=time.perf_counter() - started,
    )


def summary(result: DemoResult) -> str:
    """The lines ``trainfsm demo`` prints at the end: the accuracy, and where the files are."""
    lines = []
    if result.start_step >= result.max_steps:
        lines.append(
            f"Nothing to train: the latest checkpoint is at step {result.start_step}, and --steps is "
            f"{result.max_steps}. Pass a larger --steps to train on, or another --workspace to start over."
        )
    elif result.start_step:
        lines.append(f"Resumed from the checkpoint at step {result.start_step}, trained to step {result.step}.")
    else:
        lines.append(f"Trained from scratch for {result.step} steps.")
    lines += [
        f"Validation accuracy: {result.val_accuracy:.3f} on {result.val_size} held-out digits "
        f"({result.train_size} for training; {result.seconds:.1f} s).",
        f"Checkpoints:  {result.checkpoints.resolve()}" + (f"  (latest -> {result.latest})" if result.latest else ""),
        f"Audit trail:  {result.events.resolve()}  (attempt {result.attempt}; one JSON event per line)",
        f"Run the same command again to resume from the latest checkpoint (e.g. with --steps {result.max_steps * 2}).",
    ]
    return "\n".join(lines)
