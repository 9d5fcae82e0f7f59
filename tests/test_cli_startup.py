"""The offline commands start without torch: ``import trainfsm`` is light, its names load on first use.

``audit``, ``trace``, ``plot`` and ``diagram`` read JSON (or the machine's table); importing torch
would cost them about 2 s of a start that is otherwise ~0.2 s. Each case runs the command in a fresh
interpreter, on a real trail, and lists the torch modules loaded by the end. No timings here (the
machine is noisy): they are in the change that made the package lazy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import trainfsm
from tests.cli_helpers import run

#: The interpreters below import the trainfsm that this test process imported.
SRC = str(Path(trainfsm.__file__).parents[1])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}

RUN_CLI = """
import json, sys
from trainfsm.tools.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --help
    code = exc.code
print(json.dumps({"code": code, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def _python(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=ENV)


def _cli(*argv: Any) -> dict[str, Any]:
    """Run ``trainfsm ARGV`` in a fresh interpreter: its exit code and the torch modules it imported."""
    done = _python("-c", RUN_CLI, *(str(arg) for arg in argv))
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert result["code"] == 0, done.stdout + done.stderr
    return result


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run: 4 steps, checkpoints at 2 and 4."""
    path = tmp_path_factory.mktemp("run")
    run(path, steps=4, interval=2)
    return path


@pytest.mark.parametrize("command", [["audit"], ["audit", "--json"], ["trace"]])
def test_the_trail_commands_import_no_torch(command: list[str], workspace: Path) -> None:
    assert _cli(*command, workspace)["torch"] == []


def test_help_imports_no_torch() -> None:
    assert _cli("audit", "--help")["torch"] == []


def test_plot_imports_no_torch(workspace: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert _cli("plot", workspace, "-o", tmp_path / "run.png")["torch"] == []
    assert (tmp_path / "run.png").is_file()


def test_diagram_imports_no_torch() -> None:
    assert _cli("diagram", "--format", "mermaid")["torch"] == []


def test_python_m_trainfsm_audit_imports_no_torch(workspace: Path) -> None:
    """The real entry point, ``__main__`` included, as ``-X importtime`` lists every import."""
    done = _python("-X", "importtime", "-m", "trainfsm", "audit", str(workspace))
    assert done.returncode == 0, done.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "trainfsm.tools.audit" in imported  # the listing is there
    assert [name for name in imported if name.split(".")[0] == "torch"] == []


def test_import_trainfsm_imports_no_torch() -> None:
    done = _python("-c", "import sys, trainfsm; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_first_use_of_a_name_imports_it_and_torch_s_collectives() -> None:
    """See ``trainfsm.torch_workarounds``: from then on, a script can create its process group."""
    code = (
        "import sys, trainfsm; trainer = trainfsm.BaseTrainer; from trainfsm.trainer import BaseTrainer; "
        "print(trainer is BaseTrainer, 'torch.distributed.nn.functional' in sys.modules)"
    )
    done = _python("-c", code)
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr


def test_every_public_name_resolves_and_dir_lists_them() -> None:
    assert set(trainfsm.__all__) <= set(dir(trainfsm))
    for name in trainfsm.__all__:
        assert getattr(trainfsm, name) is not None, name
    namespace: dict[str, Any] = {}
    exec("from trainfsm import *", namespace)
    assert set(trainfsm.__all__) <= set(namespace)


def test_an_unknown_name_raises_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="module 'trainfsm' has no attribute 'BaseTrainr'"):
        trainfsm.BaseTrainr  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError, match="BaseTrainr"):
        from trainfsm import BaseTrainr  # type: ignore[attr-defined]  # noqa: F401
