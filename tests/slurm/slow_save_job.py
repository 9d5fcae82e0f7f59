"""A training job whose checkpoints take ``--write-seconds`` to become durable, for the job's end
with asynchronous saves, and whose rank 0 reads the job's end again every ``--reread-seconds``
(a minute by default), for a time limit changed during the run.

The file system is slow: each save's ``model.pt`` waits ``--write-seconds`` in its fsync (RESTORE's
probe and room are not saves), on the thread that writes it, the background writer's with
``--async-save``. ``--interval`` saves measure that write early in each attempt. The job's end is
the trainer's own deadline (``--job-end-margin`` seconds; the job asks for no signal). Without
SLURM it is the same training, uninterrupted. The final parameters go to ``WORKSPACE/final.pt``.

Used by ``tests/slurm/test_job_end.py``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--interval", type=int, default=300)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--write-seconds", type=float, default=8.0)
    parser.add_argument("--job-end-margin", type=float, default=1.0)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--reread-seconds", type=float)
    args = parser.parse_args(argv)

    import torch
    from tiny_job import TinyJobTrainer
    from torch import nn

    from trainfsm import CheckpointingHook
    from trainfsm.checkpoint import io

    sync = io.DurableWriter.sync

    def slow_sync(self: Any) -> None:
        if self._path.name == "model.pt":
            time.sleep(args.write_seconds)  # a slow file system: the save's write, not its staging
        sync(self)

    io.DurableWriter.sync = slow_sync  # type: ignore[method-assign]
    if args.reread_seconds is not None:
        from trainfsm.preemption import slurm

        setattr(slurm, "REREAD_SECONDS", args.reread_seconds)  # noqa: B010 (a Final, changed for a test)

    class Trainer(TinyJobTrainer):
        def build_hooks(self) -> list[Any]:
            return [CheckpointingHook(interval=args.interval, async_save=args.async_save, max_requeues=10)]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            time.sleep(args.step_seconds)
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    trainer = Trainer(max_steps=args.steps, workspace=args.workspace, device="cpu", job_end_margin=args.job_end_margin)
    trainer.train()  # the job's end: checkpoint, requeue, SystemExit(143)
    final = {k: v.detach() for k, v in trainer.model.state_dict().items()}  # type: ignore[union-attr]
    torch.save(final, args.workspace / "final.pt")


if __name__ == "__main__":
    main()
