"""A real small dataset: a small MLP learns scikit-learn's handwritten digits on CPU.

    python examples/digits.py --steps 300 --workspace runs/digits
    python examples/digits.py --epochs 2 --steps 100000 --workspace runs/digits2   # two passes, then stop

The data (1,797 8x8 images) ships inside scikit-learn, so nothing is downloaded (``pip install
scikit-learn``, or the ``demo`` extra). 80% trains, 20% is held out. Three hooks:

- ``ValidationHook`` evaluates on the held-out digits every ``--val-every`` steps and at the last
  step, logging ``val/loss`` and ``val/accuracy`` (``hook.last`` keeps the latest results);
- ``CheckpointingHook`` saves under ``WORKSPACE/checkpoints`` (run again to resume);
- ``ProgressHook`` prints a progress line with the batch accuracy.

The split and the trainer are the ones of ``trainfsm demo`` (``trainfsm.tools.demo``); only the hooks
differ. At the end it prints the validation accuracy it reached and where the audit trail is.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainfsm import BaseHook, CheckpointingHook, ProgressHook, ValidationHook
from trainfsm.tools.demo import DigitsTrainer, load_digits_split


class DigitsExampleTrainer(DigitsTrainer):
    """The demo's MLP and data loader, with validation, checkpointing and progress hooks."""

    def __init__(self, *args: object, val_every: int = 100, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.val_every = val_every
        self.validation = ValidationHook(
            interval=val_every,
            data_loader=DataLoader(TensorDataset(self.data.x_val, self.data.y_val), batch_size=256),
        )

    def build_hooks(self) -> list[BaseHook]:
        return [
            self.validation,
            CheckpointingHook(interval=self.checkpoint_every, keep_previous=self.keep_previous),
            ProgressHook(interval=self.log_every, with_records=True),
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--workspace", type=Path, default=Path("runs/digits"), help="run directory")
    parser.add_argument("--val-every", type=int, default=100, help="validate every N steps (and at the last)")
    parser.add_argument(
        "--epochs", type=int, default=None, help="also stop when the training data runs out this many times"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(0)
    trainer = DigitsExampleTrainer(
        load_digits_split(seed=0),
        val_every=args.val_every,
        checkpoint_every=100,
        log_every=50,
        max_steps=args.steps,
        max_epochs=args.epochs,
        workspace=args.workspace,
        device="cpu",
    )
    trainer.train()
    results = trainer.validation.last
    if results is None:  # restored at (or past) --steps: nothing trained, so nothing evaluated yet
        results = trainer.validation.validate(trainer)
    print(f"exit reason: {trainer.exit_reason}")
    print(f"validation accuracy: {float(results['accuracy']):.4f} at step {trainer.step}")
    print(f"checkpoints: {args.workspace / 'checkpoints'}")
    print(f"audit trail: {args.workspace / 'logs' / f'events.rank{trainer.rank}.jsonl'}")


if __name__ == "__main__":
    main()
