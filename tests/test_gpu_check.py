"""scripts/gpu-check.sh, tried where there is no GPU (``--dry-run``): it sets up from src/ without
installing anything, runs the GPU tier (scripts/test-gpu.sh, what ``make test-gpu`` runs), where
every ``cuda`` test is skipped with the reason tests/tiers.py gives and the overhead benchmark says
why it did not run, and ends with its summary, exit 0. The tier collects only the modules that
hold cuda tests (the GPU machine lacks packages others import): a collection of the whole suite,
run beside it, must find no cuda test it left out. Where CUDA is present the script runs the tier
itself (minutes): this test is skipped there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiers import cuda_skip_reason

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~15 s (two pytest collections): the full suite's, which CI runs
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, scripts/gpu-check.sh runs the GPU tier (minutes)")
def test_the_gpu_check_dry_run_skips_every_cuda_test_with_its_reason_and_ends_with_the_summary(tmp_path: Path) -> None:
    log = tmp_path / "out" / "gpu-check.log"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_LOG": str(log), "TMPDIR": str(tmp_path)}
    env.pop("TRAINFSM_REQUIRE_CUDA", None)
    every = subprocess.Popen(  # the whole suite's cuda tests, collected meanwhile
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "cuda",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run"],
        cwd=tmp_path,  # the script goes to the repository itself
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    collected, _ = every.communicate(timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    text = log.read_text()
    assert done.stdout == text  # all of it in the one file, as printed

    # Every cuda test was collected and skipped with the one reason; nothing else ran.
    reason = cuda_skip_reason()
    assert reason is not None
    skipped = re.findall(r"^SKIPPED \[(\d+)\] (tests/\S+?): (.*)$", text, re.MULTILINE)
    assert skipped and {why for _, _, why in skipped} == {reason}
    total = sum(int(n) for n, _, _ in skipped)
    assert total >= 20
    everywhere = re.search(r"^(\d+)/\d+ tests collected", collected, re.MULTILINE)
    assert everywhere is not None, collected[-2000:]
    assert total == int(everywhere.group(1)), f"the tier left out cuda tests that the suite has:\n{collected}"
    files = {where.split(":")[0] for _, where, _ in skipped}
    assert {"tests/test_cuda_resume.py", "tests/test_cuda_syncs.py", "tests/test_cuda_distributed.py"} <= files

    summary = text[text.index("== gpu-check summary ==") :].splitlines()
    fields = dict(line.split(":", 1) for line in summary[1:])
    assert fields["result"].strip() == "PASSED, dry run: no CUDA required"
    assert re.fullmatch(rf"0 passed, 0 failed, {total} skipped, 0 errors \(in [0-9.]+s\)", fields["tests"].strip())
    assert fields["benchmark"].strip().startswith("overhead.py --device cuda: skipped, no CUDA device")
    assert fields["torch"].strip().startswith(f"{torch.__version__}, CUDA {torch.version.cuda}")
    assert fields["gpu"].strip() == "none (torch.cuda.is_available() is False)"
    assert fields["log"].strip().startswith(f"{log} (")
    assert list(fields) == ["result", "tests", "benchmark", "python", "torch", "gpu", "nvidia-smi", "log"]
