"""MkDocs hooks: the pages and the picture that are generated from the code at each build.

Nothing here is copied into docs/, so nothing can drift: the API and hook reference list every
public name of ``trainfsm.__all__`` (mkdocstrings renders each from its docstring), the CLI page is
the commands' own ``--help``, the event reference is ``trainfsm.trail.schema``'s tables with the
console's sentence of each event (``trainfsm.trail.sentences`` of ``trainfsm.trail.examples``), and
the plot in the audit-trail guide is drawn from a real run trained (and resumed) during the build.

The site works offline (a cluster's login node): Mermaid, which MkDocs Material would otherwise
fetch from unpkg when a page has a diagram, is served from the site itself. The build takes the
pinned release's tarball from the npm registry once, checks it against npm's integrity hash, keeps
it under ``.cache/docs/`` and copies its ``mermaid.min.js`` into the site on every build.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
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

#: The Mermaid release the site serves. MkDocs Material 9.x asks for ``mermaid@11`` (the unpkg URL
#: in its bundle), so this is the newest 11.x; move both together. The integrity is the registry's
#: own (``npm view mermaid@11.17.2 dist.integrity``): a download that does not match is refused.
MERMAID_VERSION = "11.17.2"
MERMAID_INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MERMAID_TARBALL = f"https://registry.npmjs.org/mermaid/-/mermaid-{MERMAID_VERSION}.tgz"
#: Where the verified tarball is kept between builds (gitignored); the site's copy of the script,
#: which mkdocs.yml's ``extra_javascript`` loads on every page, so Material finds ``mermaid``
#: defined and fetches nothing.
MERMAID_CACHE = ROOT / ".cache" / "docs" / f"mermaid-{MERMAID_VERSION}.tgz"
MERMAID_SITE_PATH = "assets/javascripts/mermaid.min.js"
#: What the site takes from the tarball: the script, and its MIT licence beside it.
MERMAID_FILES = {
    "package/dist/mermaid.min.js": MERMAID_SITE_PATH,
    "package/LICENSE": "assets/javascripts/mermaid.LICENSE.txt",
}


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
    from trainfsm.trail import schema

    lines = [
        "# The audit trail's events",
        "",
        "Generated from `trainfsm.trail.schema` at each docs build (`EVENT_FIELDS` is what the writer and the "
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
        *_console_section(),
    ]
    return "\n".join(lines)


def _console_section() -> list[str]:
    """What the console prints of each event kind: its sentence (``trainfsm.trail.sentences``),
    rendered from that kind's example (``trainfsm.trail.examples``), or that it shows at DEBUG only."""
    from trainfsm.trail import console, examples, schema

    rows = []
    for event in schema.EVENT_FIELDS:
        example = examples.example(event)
        if console.own(example):  # every rank speaks of its own: shown as another rank's line
            example = examples.example(event, rank=1)
        text = console.sentence(example)
        if text is None:
            rows.append(f"| `{event}` | DEBUG only: its fields, no sentence |")
        elif not console.speaks(example, logging.INFO):
            rows.append(f"| `{event}` | `{text}` (shown at DEBUG only) |")
        else:
            rows.append(f"| `{event}` | `{text}`{' (every rank, of its own)' if console.own(example) else ''} |")
    debug = console.details(examples.example("transition"))
    return [
        "## What the console prints",
        "",
        "The stdlib logger `trainfsm` (or the trainer's `logger`) prints one sentence for each event a "
        "person should see, at the level it was recorded at: rank 0 speaks for every rank, and each rank "
        "of what is its own (a stall, a failure), its line beginning with `[rank R]`. Each line below is "
        "the sentence as the console prints it, rendered from a real example of the event's fields "
        f"(`trainfsm.trail.examples`); at most {console.WIDTH} characters. At DEBUG every event also shows "
        f"its fields in one line, for example `{debug}`. How to quiet or widen it: "
        "[the console](../guides/getting-started.md#the-console).",
        "",
        "| event | the console's line |",
        "|---|---|",
        *rows,
        "",
    ]


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


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def _mermaid_tarball() -> bytes:
    """The pinned Mermaid tarball: the cached copy when it checks out, else downloaded once."""
    if MERMAID_CACHE.is_file():
        data = MERMAID_CACHE.read_bytes()
        if _integrity(data) == MERMAID_INTEGRITY:
            return data  # else a truncated or altered copy: downloaded again below
    try:
        with urllib.request.urlopen(MERMAID_TARBALL, timeout=120) as response:
            data = bytes(response.read())
    except OSError as exc:
        raise PluginError(
            f"docs: could not download Mermaid {MERMAID_VERSION} from {MERMAID_TARBALL} ({exc}), and "
            f"{MERMAID_CACHE} holds no verified copy. The site serves Mermaid itself so that it works "
            "offline; build once where registry.npmjs.org is reachable (an HTTPS_PROXY is honoured), or "
            f"put that tarball at {MERMAID_CACHE}."
        ) from exc
    if _integrity(data) != MERMAID_INTEGRITY:
        raise PluginError(
            f"docs: {MERMAID_TARBALL} does not match its pinned integrity ({_integrity(data)[:30]}... != "
            f"{MERMAID_INTEGRITY[:30]}...); nothing was cached. If mermaid {MERMAID_VERSION} is meant to "
            "change, update MERMAID_VERSION and MERMAID_INTEGRITY in scripts/docs_hooks.py together."
        )
    MERMAID_CACHE.parent.mkdir(parents=True, exist_ok=True)
    partial = MERMAID_CACHE.with_name(f"{MERMAID_CACHE.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    partial.replace(MERMAID_CACHE)  # whole or absent, with two builds at once too
    return data


def _mermaid_files() -> dict[str, bytes]:
    """The site's copies (by their path in the site) of ``MERMAID_FILES``."""
    found = {}
    with tarfile.open(fileobj=io.BytesIO(_mermaid_tarball()), mode="r:gz") as tar:
        for name, site_path in MERMAID_FILES.items():
            member = tar.extractfile(name)
            if member is None:
                raise PluginError(f"docs: the Mermaid {MERMAID_VERSION} tarball has no {name}")
            found[site_path] = member.read()
    return found


def on_files(files: Files, config: Any) -> Files:
    for path, content in _mermaid_files().items():  # first: without them the build fails, and fast
        files.append(File.generated(config, path, content=content))
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
