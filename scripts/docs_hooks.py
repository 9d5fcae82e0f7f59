"""MkDocs hooks: the pages and the picture that are generated from the code at each build.

Nothing here is copied into docs/, so nothing can drift: the API and hook reference list every
public name of ``trainfsm.__all__`` (mkdocstrings renders each from its docstring), the CLI page is
the commands' own ``--help``, the event reference is ``trainfsm.schema``'s tables, and the plot in
the audit-trail guide is drawn from a real run trained (and resumed) during the build.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
#: Public names outside ``__all__`` that users' code reads or builds, and the utility modules
#: (documented with the API, each module with its public functions).
MORE_API = (
    "trainfsm.step_info.StepInfo",
    "trainfsm.checkpoint.CheckpointStore",
    "trainfsm.trail.read_events",
    "trainfsm.schedules",
    "trainfsm.lr_finder",
    "trainfsm.devices",
    "trainfsm.distributed",
)


def _public() -> tuple[list[tuple[str, str, list[str]]], list[tuple[str, str, list[str]]]]:
    """(API entries, hook entries): (name, the object's import path, its other published names)."""
    import trainfsm
    from trainfsm.hooks.base import BaseHook

    seen: dict[int, tuple[str, str, list[str]]] = {}
    for name in sorted(trainfsm.__all__, key=str.lower):
        if name == "__version__":
            continue
        obj = getattr(trainfsm, name)
        module = trainfsm._SOURCES[name]
        path = f"{obj.__module__}.{obj.__qualname__}" if isinstance(obj, type) or callable(obj) else f"{module}.{name}"
        key = id(obj)
        if key in seen:  # an alias (CUDAMaxMemoryHook, EMAHook): one entry, both names
            seen[key][2].append(name)
            continue
        seen[key] = (name, path, [])
    entries = list(seen.values())
    hooks = [
        e
        for e in entries
        if isinstance(getattr(trainfsm, e[0]), type) and issubclass(getattr(trainfsm, e[0]), BaseHook)
    ]
    api = [e for e in entries if e not in hooks]
    api += [(path.rsplit(".", 1)[1], path, []) for path in MORE_API]
    return api, hooks


def _entries_page(title: str, intro: str, entries: list[tuple[str, str, list[str]]]) -> str:
    lines = [f"# {title}", "", intro, ""]
    for name, path, aliases in entries:
        # mkdocstrings' heading (with the signature under it) is anchored at the object's path; the
        # short anchor (#checkpointinghook) is kept for the links that use it.
        lines += [f'<a id="{name.lower()}"></a>', "", f"::: {path}"]
        if aliases:  # one entry for all its names, the class's own first (its signature's)
            own = path.rsplit(".", 1)[1]
            others = sorted({name, *aliases} - {own})
            lines += ["    options:", f'      heading: "{own} (also published as {", ".join(others)})"']
        lines.append("")
    return "\n".join(lines)


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "trainfsm", *args, "--help"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"trainfsm {' '.join(args)} --help failed: {done.stderr}")
    return done.stdout.rstrip()


def _cli_page() -> str:
    main = _help()
    commands = re.findall(r"^    (\w+) {2,}", main, flags=re.MULTILINE)
    lines = [
        "# The `trainfsm` command",
        "",
        "Generated from the commands' own `--help` at each docs build. The guide to what each command is "
        "for is [the audit trail and the `trainfsm` command](../guides/audit-trail.md).",
        "",
        "```text",
        main,
        "```",
        "",
    ]
    for command in commands:
        lines += [f"## `trainfsm {command}`", "", "```text", _help(command), "```", ""]
    return "\n".join(lines)


def _events_page() -> str:
    from trainfsm import schema

    lines = [
        "# The audit trail's events",
        "",
        "Generated from `trainfsm.schema` at each docs build (`EVENT_FIELDS` is what the writer and the "
        f"readers check; this page is `EVENT_DOCS`). Trail format {schema.FORMAT_VERSION}; readers take "
        f"formats {', '.join(map(str, schema.READABLE_FORMATS))}. What the trail is and how to read it: "
        "[the audit trail](../guides/audit-trail.md).",
        "",
        "## Fields of every event",
        "",
        "| field | meaning |",
        "|---|---|",
        *(f"| `{field}` | {meaning} |" for field, meaning in schema.COMMON_FIELDS.items()),
        "",
        "## Events",
        "",
        "| event | fields | when |",
        "|---|---|---|",
        *(f"| `{event}` | {fields} | {when} |" for event, (fields, when) in schema.EVENT_DOCS.items()),
        "",
        "Exit reasons: " + ", ".join(f"`{reason}`" for reason in schema.EXIT_REASONS) + ".",
        "",
    ]
    return "\n".join(lines)


def _run_plot(out: Path) -> None:
    """A real run, interrupted and resumed (``trainfsm demo`` twice on one workspace), plotted."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MPLBACKEND": "Agg"}
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp) / "demo"
        for steps in ("150", "300"):
            subprocess.run(
                [sys.executable, "-m", "trainfsm", "demo", "--workspace", str(workspace), "--steps", steps],
                check=True,
                capture_output=True,
                env=env,
            )
        subprocess.run(
            [sys.executable, "-m", "trainfsm", "plot", str(workspace), "-o", str(out), "--title", "trainfsm demo"],
            check=True,
            capture_output=True,
            env=env,
        )


def on_files(files: Files, config: Any) -> Files:
    api, hooks = _public()
    pages = {
        "reference/api.md": _entries_page(
            "API reference",
            "Every public name of `trainfsm` (its `__all__`) but the hooks, and the types users' code reads, "
            "rendered from their docstrings at each docs build.",
            api,
        ),
        "reference/hooks.md": _entries_page(
            "Hooks reference",
            "`BaseHook` and every built-in hook, rendered from their docstrings at each docs build. When each "
            "method fires: [the machine and its hooks](../guides/machine-and-hooks.md).",
            hooks,
        ),
        "reference/cli.md": _cli_page(),
        "reference/events.md": _events_page(),
    }
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "run.png"
        _run_plot(image)
        files.append(File.generated(config, "assets/run.png", content=image.read_bytes()))
    return files
