"""The guides' and the README's complete scripts run, as the examples do.

A fenced ``python`` block that defines a trainer and calls ``.train()`` is a complete script: it
is run as a file in a fresh directory (CPU, 120 s at most). Scripts that live in examples/ are
included into the docs with ``--8<-- "examples/..."`` and run by the examples' own tests, so an
include is not run twice here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def scripts() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for number, block in enumerate(FENCE.findall(page.read_text()), start=1):
            if ".train()" in block and "--8<--" not in block:
                found.append((f"{page.relative_to(ROOT)}#{number}", block))
    return found


def test_the_docs_have_complete_scripts_to_run() -> None:
    # The README's quick start at least: a pattern that finds nothing would pass every page.
    assert any(name.startswith("README.md") for name, _ in scripts())


#: Scripts run in `make test-all` only: the README's trains 1,000 steps (examples/quickstart.py, the
#: same trainer, runs in the fast tier).
SLOW_SCRIPTS = {"README.md#1"}


@pytest.mark.parametrize(
    ("name", "code"),
    [pytest.param(name, code, id=name, marks=[pytest.mark.slow] * (name in SLOW_SCRIPTS)) for name, code in scripts()],
)
def test_a_complete_script_in_the_docs_runs(name: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_every_snippet_the_docs_include_exists() -> None:
    for page in PAGES:
        for included in re.findall(r'^\s*--8<-- "([^"]+)"', page.read_text(), flags=re.MULTILINE):
            assert (ROOT / included).is_file(), f"{page.relative_to(ROOT)} includes {included}, which is missing"


def test_the_guides_transition_table_is_the_machines() -> None:
    from trainfsm import machine

    page = (ROOT / "docs" / "guides" / "machine-and-hooks.md").read_text()
    section = page.split("### Transitions", 1)[1]
    rows = set()
    for trigger, sources, dest in re.findall(r"^\| `(\w+)` \| ([^|]+) \| (\w+) \|", section, flags=re.MULTILINE):
        if sources.strip() == "every state but EXIT":
            names = [state for state in machine.STATES if state != machine.EXIT]
        else:
            names = [name.strip() for name in sources.split(",")]
        rows |= {(trigger, source, dest) for source in names}
    assert rows == set(machine.transition_rows())


def test_the_guide_names_every_hook_method_and_every_built_in_hook() -> None:
    import trainfsm
    from trainfsm.hooks.base import BaseHook

    page = (ROOT / "docs" / "guides" / "machine-and-hooks.md").read_text()
    methods = [name for name in vars(BaseHook) if name.startswith(("on_", "wants_"))]
    assert methods and all(f"`{name}" in page for name in methods), [m for m in methods if f"`{m}" not in page]
    hooks = [n for n in trainfsm.__all__ if isinstance(getattr(trainfsm, n, None), type) and n.endswith("Hook")]
    missing = [name for name in hooks if f"`{name}`" not in page]
    assert not missing, f"built-in hooks the guide does not name: {missing}"
