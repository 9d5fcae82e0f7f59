"""The getting-started guide, followed as written: its script, its commands, and the loss curve.

The script is the guide's ``python`` block with its ``--8<--`` include resolved, as the docs build
resolves it; the commands are the guide's ``bash`` lines that run the script or ``trainfsm plot``,
in the guide's order, run in a fresh directory. The picture's loss series is then read back the
way ``trainfsm plot`` reads it (``trainfsm.tools.plot.collect``).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

# Slow: it trains the guide's script twice and plots it (the quickstart and `trainfsm plot` run in the fast tier).
pytestmark = [pytest.mark.docs, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "getting-started.md"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(GUIDE.read_text()) if lang == language]


def guide_script() -> tuple[str, str]:
    """(the path the guide runs the script as, the script): the guide's complete ``python`` block."""
    [block] = [body for body in _blocks("python") if "--8<--" in body]
    [included] = INCLUDE.findall(block)
    return included, INCLUDE.sub(lambda m: (ROOT / m.group(1)).read_text(), block).rstrip("\n") + "\n"


def guide_commands(script: str) -> list[str]:
    """The guide's commands that run ``script`` or ``trainfsm plot``, in order."""
    lines = [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line.startswith((f"python {script} ", "trainfsm plot "))]


def test_the_guides_script_gives_trainfsm_plot_a_loss_curve(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trainfsm.tools.plot import collect

    path, script = guide_script()
    commands = guide_commands(path)
    assert commands == [  # the first run, the resume, the picture: if the guide changes, so does this
        f"python {path} --steps 100 --workspace runs/quickstart",
        f"python {path} --steps 200 --workspace runs/quickstart",
        "trainfsm plot runs/quickstart -o runs/quickstart/run.png",
    ]
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg"}
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        program = [sys.executable] if argv[0] == "python" else [sys.executable, "-m", "trainfsm"]
        done = subprocess.run([*program, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    assert "exit reason: completed" in outputs[0] and "exit reason: completed" in outputs[1]
    # What the guide shows: the curves add 3 inches (300 px) to the timeline; no "timeline only".
    assert outputs[2] == "wrote runs/quickstart/run.png (1200x580 px): 1 rank, 2 attempts\n"
    assert (tmp_path / "runs" / "quickstart" / "run.png").is_file()

    timeline, _ = collect([tmp_path / "runs" / "quickstart"])
    loss = timeline.metrics["loss"]
    assert sorted(loss) == list(range(10, 201, 10))  # LoggingHook(interval=10), across the resume
    assert all(math.isfinite(value) for value in loss.values())
    assert 2.0 < loss[10] < 2.5  # about ln(10): ten classes, nothing learnt yet
    assert loss[100] < 0.5 * loss[10] and loss[200] < 0.5 * loss[100]  # it learns, and goes on after the resume
    assert timeline.metrics["lr/group_0"] == dict.fromkeys(range(10, 201, 10), 1e-3)  # Adam's lr, constant
