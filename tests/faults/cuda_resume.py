"""A run on CUDA killed with SIGKILL and resumed must end bit-exact with one that was never killed
(tests/test_cuda_resume.py; the GPU tier).

The trainer draws from every random stream a resume must restore: dropout on the GPU (CUDA's
generator), noise drawn on the GPU in ``forward``, a shuffling DataLoader (the CPU generator).
Mixed precision is the ``--precision`` given: ``fp16`` runs a ``GradScaler`` that grows its scale
every ``GROWTH_INTERVAL`` finite steps, so its scale and growth tracker change during the run and
must come back from the checkpoint; ``bf16`` has no scaler, and a non-finite step is retried
(RETRY). Each run has a non-finite loss injected at the first forward of the steps in
``NAN_STEPS``: one before the kill and one after the resume (the scaler's skip-and-rescale, or a
retry, on both sides of it).

Determinism (what a bit-exact comparison on CUDA needs, set before CUDA is first used):
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's reductions in a fixed order; torch refuses some
cuBLAS calls under deterministic algorithms without it) and ``torch.use_deterministic_algorithms(True)``
(an op without a deterministic kernel raises instead of varying); cuDNN is not used by this model.

    python tests/faults/cuda_resume.py --workspace W --out OUT --precision fp16 [--kill-at 8]

writes the final parameters, the scaler's state and CUDA's random state to OUT when it finishes;
with ``--kill-at S`` it SIGKILLs itself as step S ends (after the checkpoint of step 6, before
the one of step 9).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
STEPS, INTERVAL, KILL_AT = 12, 3, 8
NAN_STEPS = (2, 10)
INIT_SCALE, GROWTH_INTERVAL = 2.0**8, 2
#: The environment a deterministic CUDA run needs from its start (see the module's docstring).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "0"}


def child(workspace: Path, out: Path, precision: str, kill_at: int, device: str = "cuda") -> None:
    import torch
    from torch import nn

    from trainfsm import BaseHook, BaseTrainer, CheckpointingHook

    torch.use_deterministic_algorithms(True)

    class Kill(BaseHook):
        """SIGKILL this process as step ``at`` ends: no handler runs, nothing is flushed."""

        def on_after_step(self, trainer: BaseTrainer) -> None:
            if trainer.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    class Trainer(BaseTrainer):
        injected: set[int]

        def build_data_loader(self) -> Any:
            self.injected = set()
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(96, 32, generator=g), torch.randn(96, 1, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)  # 6 steps an epoch

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
            return model.to(self.device)

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.model.parameters(), lr=1e-3)  # type: ignore[union-attr]

        def build_grad_scaler(self) -> torch.amp.GradScaler:
            # A small initial scale that grows every GROWTH_INTERVAL finite steps: the scale and the
            # growth tracker at the kill differ from a fresh scaler's.
            enabled = self.mixed_precision == "fp16"
            return torch.amp.GradScaler(
                self.device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, enabled=enabled
            )

        def build_hooks(self) -> list[Any]:
            return [CheckpointingHook(interval=INTERVAL, keep_previous=1), Kill()]

        def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            x, y = (t.to(self.device) for t in input)
            noise = torch.randn(x.shape, device=self.device)  # CUDA's generator, beside dropout's
            loss = nn.functional.mse_loss(self.model(x + 0.01 * noise).float(), y)  # type: ignore[misc]
            if self.step in NAN_STEPS and self.step not in self.injected:  # the step's first forward
                self.injected.add(self.step)
                loss = loss * float("nan")
            return loss, {}

    retries = 1 if precision == "bf16" else 0  # fp16: the scaler skips the step instead
    trainer = Trainer(
        max_steps=STEPS,
        workspace=workspace,
        device=device,
        mixed_precision=precision,
        max_non_finite_grad_retries=retries,
    )
    trainer.train()
    scaler = trainer.grad_scaler
    assert scaler is not None
    torch.save(
        {
            "params": [p.detach().cpu() for p in trainer.model.parameters()],  # type: ignore[union-attr]
            "scaler": scaler.state_dict() if scaler.is_enabled() else {},
            "cuda_rng": torch.cuda.get_rng_state() if device == "cuda" else torch.zeros(0),
            "cpu_rng": torch.get_rng_state(),
        },
        out,
    )


def launch(
    workspace: Path, out: Path, precision: str, kill_at: int = 0, device: str = "cuda", timeout: float = 240
) -> Any:
    """Run the child to its end (or its kill); the completed process, stderr captured. ``device``:
    "cpu" tries the same on CPU (the script's own check, where no GPU is at hand)."""
    command = [sys.executable, str(HERE), "--workspace", str(workspace), "--out", str(out)]
    command += ["--precision", precision, "--kill-at", str(kill_at), "--device", device]
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **DETERMINISTIC_ENV, "PYTHONPATH": path}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--precision", choices=("bf16", "fp16"), required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu: the same run on CPU (a check of the script)")
    args = parser.parse_args()
    child(args.workspace, args.out, args.precision, args.kill_at, args.device)


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(ROOT))
    main()
