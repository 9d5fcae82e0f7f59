"""Style is part of the tests: ruff and mypy --strict on the package, as CI sees them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff is not installed (pip install -e '.[dev]')",
)
def test_ruff_check_is_clean() -> None:
    result = _run("ruff", "check", "src", "tests", "benchmarks", "examples")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[dev]')")
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_trainfsm_loads_no_optional_heavyweights() -> None:
    code = (
        "import sys, trainfsm; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'tensorboard', 'matplotlib', 'sklearn')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
