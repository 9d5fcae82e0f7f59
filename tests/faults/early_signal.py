"""A training script that can be made slow in one place before its first step, for real signals.

``--slow-in build_data_loader|build_model|build_optimizer|build_hooks|load`` makes that method (or,
for ``load``, reading the checkpoint in RESTORE) write ``--marker`` and then take ``--slow``
seconds, so a test can signal the process exactly there. ``--exit-signals`` is the checkpoint
hook's policy (known to the trainer only once ``build_hooks()`` returned); ``--user-handler SIG``
installs the script's own handler for SIG before ``train()`` (it writes ``<marker>.handled``),
``--ignore SIG`` sets SIG to be ignored. The final parameters go to ``--out``.

Used by ``tests/test_signals_any_instant.py`` and ``tests/slurm/test_preemption.py``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

PLACES = ("build_data_loader", "build_model", "build_optimizer", "build_hooks", "load")
HERE = Path(__file__).resolve()


def _signals(names: str) -> list[signal.Signals]:
    return [signal.Signals[f"SIG{name}"] for name in names.split(",") if name]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--slow-in", choices=PLACES)
    parser.add_argument("--slow", type=float, default=2.0)
    parser.add_argument("--marker", type=Path)
    parser.add_argument("--exit-signals", default="USR1,TERM", help="e.g. USR1,TERM; empty for none")
    parser.add_argument("--user-handler", default="", help="a signal name, e.g. USR2")
    parser.add_argument("--ignore", default="", help="a signal name, e.g. USR2")
    args = parser.parse_args(argv)

    import torch
    from torch import nn

    from trainfsm import BaseTrainer, CheckpointingHook
    from trainfsm.checkpoint.store import CheckpointStore

    def slow(place: str) -> None:
        if args.slow_in == place:
            args.marker.write_text(place)
            time.sleep(args.slow)  # a handler that only records lets the sleep go on (PEP 475)

    if args.slow_in == "load":
        load = CheckpointStore.load

        def slow_load(path: Path, manifest: Any = None) -> Any:
            slow("load")
            return load(path, manifest)

        CheckpointStore.load = staticmethod(slow_load)  # type: ignore[method-assign, assignment]

    class Trainer(BaseTrainer):
        def build_data_loader(self) -> Any:
            slow("build_data_loader")
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

        def build_model(self) -> nn.Module:
            slow("build_model")
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))

        def build_optimizer(self) -> torch.optim.Optimizer:
            slow("build_optimizer")
            return torch.optim.Adam(self.model.parameters(), lr=0.01)  # type: ignore[union-attr]

        def build_hooks(self) -> list[Any]:
            slow("build_hooks")
            return [CheckpointingHook(interval=args.interval, exit_signals=_signals(args.exit_signals))]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            x, y = input
            return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]

    if args.user_handler:
        handled = Path(f"{args.marker}.handled")
        signal.signal(_signals(args.user_handler)[0], lambda signum, frame: handled.write_text(str(signum)))
    if args.ignore:
        signal.signal(_signals(args.ignore)[0], signal.SIG_IGN)
    torch.manual_seed(1234)
    trainer = Trainer(max_steps=args.steps, workspace=args.workspace, device="cpu")
    trainer.train()
    torch.save([p.detach() for p in trainer.model.parameters()], args.out)  # type: ignore[union-attr]


if __name__ == "__main__":
    sys.exit(main())
