"""Kill and resume on CUDA, bit-exact, with bf16 autocast and with fp16 and its grad scaler (the GPU
tier, ``make test-gpu``): the run of tests/faults/cuda_resume.py is SIGKILLed as step 8 ends and
relaunched; its final parameters, the scaler's state and CUDA's random state must equal those of a
run that was never killed, and each run met its injected non-finite steps the same way (the
scaler's skip-and-rescale in fp16, RETRY in bf16), one of them after the resume.

Determinism: both runs set ``torch.use_deterministic_algorithms(True)`` and
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (tests/faults/cuda_resume.py says why); the same GPU, driver and
torch run both, as they do a run and its resume on one machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.faults.cuda_resume import INIT_SCALE, INTERVAL, KILL_AT, NAN_STEPS, STEPS, launch
from tests.helpers import ledger_problem, trail_events

pytestmark = pytest.mark.cuda


def non_finite(workspace: Path) -> list[tuple[int, str, float | None]]:
    """(step, what, the scale before the skip) of every non_finite event, every attempt."""
    return [(e["step"], e["what"], e["scale"]) for e in trail_events(workspace) if e["event"] == "non_finite"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_run_killed_on_cuda_resumes_bit_exact_with_its_scaler_and_random_states(
    tmp_path: Path, precision: str
) -> None:
    check_kill_and_resume(tmp_path, precision, "cuda")


def check_kill_and_resume(tmp_path: Path, precision: str, device: str) -> None:
    """The test, on ``device`` (tried on CPU by hand where no GPU is at hand: ``device="cpu"``)."""
    straight = launch(tmp_path / "straight", tmp_path / "straight.pt", precision, device=device)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = launch(tmp_path / "run", tmp_path / "run.pt", precision, kill_at=KILL_AT, device=device)
    assert killed.returncode == -9, f"expected SIGKILL at step {KILL_AT}: {killed.returncode}\n{killed.stderr[-3000:]}"
    assert not (tmp_path / "run.pt").exists()
    resumed = launch(tmp_path / "run", tmp_path / "run.pt", precision, device=device)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    loaded = [e for e in trail_events(tmp_path / "run") if e["event"] == "checkpoint_loaded"]
    assert [e["from_step"] for e in loaded] == [KILL_AT // INTERVAL * INTERVAL]  # step 6's, then steps 7-12 again
    if precision == "fp16":
        # The scale before each skip: 2**8 at step 2; then halved, and doubled after every 2 finite
        # steps (4, 6, 8): 2**10 at step 10. A resume from step 6 with a fresh scaler (2**8, not
        # the saved 2**9) would meet step 10 at 2**9.
        expected = [(2, "scaler_skip", INIT_SCALE), (10, "scaler_skip", INIT_SCALE * 4)]
    else:
        expected = [(step, "gradients", None) for step in NAN_STEPS]  # RETRY, no scaler
    assert non_finite(tmp_path / "straight") == expected
    # The killed attempt met step 2's; the resumed one step 10's (step 2 lies before its checkpoint).
    assert non_finite(tmp_path / "run") == expected
    assert ledger_problem(tmp_path / "run") == ""  # each micro-batch trained once over both attempts

    a: dict[str, Any] = torch.load(tmp_path / "straight.pt")
    b: dict[str, Any] = torch.load(tmp_path / "run.pt")
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y), f"parameters differ after the resume ({precision})"
    assert torch.equal(a["cuda_rng"], b["cuda_rng"]) and torch.equal(a["cpu_rng"], b["cpu_rng"])
    assert a["scaler"] == b["scaler"]
    if precision == "fp16":  # 2**9 after step 10's skip, 2**10 after steps 11 and 12
        assert (a["scaler"]["scale"], a["scaler"]["_growth_tracker"]) == (INIT_SCALE * 4, 0)
    finished = [e for e in trail_events(tmp_path / "run") if e["event"] == "exit"]
    assert [(e["reason"], e["step"]) for e in finished] == [("completed", STEPS)]
