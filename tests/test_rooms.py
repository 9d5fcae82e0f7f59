"""One room per concern, and imports that point down (issue 32).

The runtime's modules sit in rooms, lowest first; a module imports, at run time (imports under
``if TYPE_CHECKING:`` are for type checkers only), only modules of its own room or lower ones.
The offline tools (``tools/``) are never imported by the runtime, nor are the extras a user's
script calls itself (``distributed``, ``devices``, ``schedules``, ``lr_finder``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "trainfsm"

#: Room of each runtime module or package (a package's modules share its room), lowest first.
ROOMS: dict[str, int] = {
    # the table, the checks and their constants, small helpers: they import nothing higher
    "machine": 0,
    "options": 0,
    "utils": 0,
    "torch_workarounds": 0,
    "ddp_buckets": 0,  # a DDP's bucket layout across a resume (private torch API, in one place)
    "data_order": 0,  # the global position in an epoch's order, across world sizes: arithmetic
    "plain_state": 0,
    "rng": 0,
    "step_info": 0,
    "hooks.base": 0,  # the contract the trainer calls: BaseHook, not a built-in hook
    "activity": 0,  # what a stalled rank is doing: each module names its own functions here
    "trail": 1,
    "collectives": 2,
    "data_state": 2,
    "data_cursor": 2,
    "checkpoint": 3,
    "preemption": 3,
    "step": 4,
    "oom": 4,  # out of memory as a transition: the split, the kept micro-batches, the ranks' agreement
    "finite": 4,
    "resume": 4,
    "watchdog": 4,
    "run": 5,
    "states": 5,  # what each state does (the trainer's loop calls it with the trainer and its Run)
    "trainer": 5,
    "hooks": 6,
}
OFFLINE = ("tools", "__main__")
EXTRAS = ("distributed", "devices", "schedules", "lr_finder")


def room(module: str) -> str | None:
    """The ROOMS key (or offline/extra name) ``trainfsm.<module>`` belongs to; None for the package."""
    parts = module.split(".")
    for length in range(len(parts), 0, -1):
        key = ".".join(parts[:length])
        if key in ROOMS or key in OFFLINE or key in EXTRAS:
            return key
    return None


def runtime_imports(path: Path) -> set[str]:
    """The ``trainfsm`` modules ``path`` imports at run time, relative to the package."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for child in node.body for inner in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainfsm"):
            base = node.module.removeprefix("trainfsm").lstrip(".")
            for alias in node.names:  # `from trainfsm.trail import files`: the module trail.files
                candidate = f"{base}.{alias.name}".lstrip(".")
                found.add(candidate if (SRC / f"{candidate.replace('.', '/')}.py").exists() else base)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("trainfsm.") for a in node.names if a.name.startswith("trainfsm."))
    return {m for m in found if m}


def module_name(path: Path) -> str:
    """``checkpoint.store`` for checkpoint/store.py, ``checkpoint`` for its ``__init__``, "" for the package's."""
    relative = path.relative_to(SRC).with_suffix("").as_posix().replace("/", ".")
    return "" if relative == "__init__" else relative.removesuffix(".__init__")


RUNTIME = sorted(
    (module_name(p), p)
    for p in SRC.rglob("*.py")
    if room(module_name(p)) in ROOMS  # not the package's __init__, the tools or the extras
)


@pytest.mark.parametrize(("name", "path"), RUNTIME, ids=[name for name, _ in RUNTIME])
def test_a_runtime_module_imports_only_its_own_room_or_lower(name: str, path: Path) -> None:
    mine = ROOMS[room(name)]  # type: ignore[index]
    upward = sorted(
        imported
        for imported in runtime_imports(path)
        if room(imported) not in ROOMS or ROOMS[room(imported)] > mine  # type: ignore[index]
    )
    assert upward == [], f"trainfsm.{name} (room {mine}) imports higher rooms, tools or extras: {upward}"


def test_every_module_of_the_runtime_has_a_room() -> None:
    homeless = sorted(
        module_name(p) for p in SRC.rglob("*.py") if module_name(p) != "" and room(module_name(p)) is None
    )
    assert homeless == []


def test_the_rule_sees_an_upward_import(tmp_path: Path) -> None:
    """The check above can fail: a checkpoint module that imports the trainer is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainfsm.run import Run\n"
        "def f():\n    from trainfsm.trainer import BaseTrainer\n"
    )
    assert runtime_imports(bad) == {"trainer"}
    assert ROOMS[room("trainer")] > ROOMS[room("checkpoint.save")]  # type: ignore[index]


def test_hooks_holds_only_hooks() -> None:
    """Every module of ``hooks/`` (besides ``base``) defines a ``BaseHook`` subclass."""
    import importlib
    import inspect

    from trainfsm.hooks.base import BaseHook

    without = []
    for path in sorted((SRC / "hooks").glob("*.py")):
        if path.stem in ("__init__", "base"):
            continue
        module = importlib.import_module(f"trainfsm.hooks.{path.stem}")
        defined = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
        if not any(issubclass(c, BaseHook) for c in defined):
            without.append(path.name)
    assert without == []


def _imported_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith('trainfsm')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_importing_the_trainer_imports_no_built_in_hook_and_no_tool() -> None:
    loaded = _imported_by("import trainfsm.trainer")
    assert "trainfsm.trainer" in loaded
    assert sorted(m for m in loaded if m.startswith("trainfsm.hooks.") and m != "trainfsm.hooks.base") == []
    assert sorted(m for m in loaded if m.startswith("trainfsm.tools") or m.split(".")[1:2] == ["distributed"]) == []


def test_the_checkpoint_hook_imports_the_checkpoint_room_not_other_hooks() -> None:
    loaded = _imported_by("import trainfsm.hooks.checkpointing")
    assert sorted(m for m in loaded if m.startswith("trainfsm.hooks.")) == [
        "trainfsm.hooks.base",
        "trainfsm.hooks.checkpointing",
    ]


OLD_IMPORT_PATHS = (
    "from trainfsm.checkpoint import CheckpointStore, CheckpointError",
    "from trainfsm.distributed import init_distributed, cleanup_distributed, elastic_group",
    "from trainfsm.trail import read_events",
    "from trainfsm.preemption import exit_policy, ExitPolicy",
    "from trainfsm.hooks import CheckpointingHook, LoggingHook, BaseHook",
    "from trainfsm import BaseTrainer, CheckpointingHook, key_average, map_nested_tensor",
)


def test_old_import_paths_keep_working() -> None:
    """All of them in a fresh interpreter, in both orders (two interpreters, as each costs torch's
    import rather than one each): a path that works only after another's imports fails in one order."""
    for statements in (OLD_IMPORT_PATHS, OLD_IMPORT_PATHS[::-1]):
        code = "; ".join(f"exec({statement!r})" for statement in statements)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
