"""The built docs site: a reference that shows every constructor, and a site that works offline.

The site is built once for this module (``mkdocs build --strict`` into a temporary directory; the
build trains and plots the demo, so it takes about half a minute). Skipped when the docs extras
are not installed (``make docs`` installs them), unless ``TRAINFSM_REQUIRE_DOCS`` is set.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import importlib.util
import inspect
import io
import os
import posixpath
import re
import subprocess
import sys
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import trainfsm
from trainfsm.hooks.base import BaseHook

# The tests that take the built site are marked slow (`make test-all`): the build takes about a minute.
pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
MERMAID_JS = "assets/javascripts/mermaid.min.js"

needs_docs_extras = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("mkdocs", "material", "mkdocstrings_handlers"))
    and not os.environ.get("TRAINFSM_REQUIRE_DOCS"),
    reason="the docs extras are not installed (`make docs` installs them; set TRAINFSM_REQUIRE_DOCS=1 to insist)",
)


def _docs_hooks() -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module("docs_hooks")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def _reference_classes() -> list[type]:
    """Every class the API and hooks reference show: those of ``trainfsm.__all__`` and the extra
    public types the reference adds (``docs_hooks.MORE_API``), each once."""
    found: dict[int, type] = {}
    for name in trainfsm.__all__:
        obj = getattr(trainfsm, name)
        if isinstance(obj, type):
            found.setdefault(id(obj), obj)
    for path in _docs_hooks().MORE_API:
        module, _, name = path.rpartition(".")
        obj = getattr(importlib.import_module(module), name, None) if module else None
        if isinstance(obj, type):
            found.setdefault(id(obj), obj)
            DOCUMENTED_AT[id(obj)] = path  # the documented import path, e.g. trainfsm.checkpoint.CheckpointStore
    return sorted(found.values(), key=lambda cls: cls.__name__)


#: Classes the reference shows under a path other than where they are defined.
DOCUMENTED_AT: dict[int, str] = {}
CLASSES = _reference_classes()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return out


# ---------------------------------------------------------------- the reference's signatures
def _qualifiers_dropped(text: str) -> str:
    """``torch.device`` -> ``device``: the reference shows a type by its name (its path in a tooltip)."""
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])", "", text)


def _flat(text: str) -> str:
    """One line, with no space inside brackets or before a comma, and double quotes throughout."""
    text = re.sub(r"\s+", " ", text).replace("'", '"')
    return re.sub(r"\s*([\])},])", r"\1", re.sub(r"([\[({])\s*", r"\1", text)).strip()


def _expected_parameters(cls: type) -> list[str]:
    """Each constructor argument as the reference must show it: ``name: type = default``."""
    wanted = []
    for parameter in inspect.signature(cls).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        text = prefix + parameter.name
        if parameter.annotation is not inspect.Parameter.empty:
            annotation = parameter.annotation
            text += ": " + (annotation if isinstance(annotation, str) else inspect.formatannotation(annotation))
        if parameter.default is not inspect.Parameter.empty:
            # A dataclass field's default_factory: inspect says <factory>, the reference ``dict()``.
            factory = parameter.default is dataclasses._HAS_DEFAULT_FACTORY  # type: ignore[attr-defined]
            text += " = <factory>" if factory else f" = {parameter.default!r}"
        wanted.append(_flat(_qualifiers_dropped(text)))
    return wanted


def _own_constructor(cls: type) -> bool:
    """The class (or a base of ours) defines ``__init__``: warnings and exceptions take Python's."""
    owner = next(klass for klass in cls.__mro__ if "__init__" in vars(klass))
    return owner.__module__.startswith("trainfsm.")


def _page_of(cls: type) -> str:
    return "hooks" if issubclass(cls, BaseHook) else "api"


def _rendered_signature(site: Path, cls: type) -> str:
    """The signature shown right under the class's own heading (not another object's), as text."""
    page = (site / "reference" / _page_of(cls) / "index.html").read_text()
    path = DOCUMENTED_AT.get(id(cls), f"{cls.__module__}.{cls.__qualname__}")
    heading = re.search(rf'<h\d id="{re.escape(path)}" class="doc doc-heading".*?</h\d>', page, flags=re.DOTALL)
    assert heading, f"reference/{_page_of(cls)} has no heading for {path}"
    after = page[heading.end() :]
    signature = re.match(r'\s*<div class="doc-signature[^"]*">(.*?)</code></pre>', after, flags=re.DOTALL)
    assert signature, (
        f"reference/{_page_of(cls)}: no signature under {cls.__name__}'s heading (mkdocstrings' "
        f"merge_init_into_class and separate_signature show it): {after[:300]!r}"
    )
    return _flat(_qualifiers_dropped(html.unescape(re.sub(r"<[^>]+>", "", signature.group(1)))))


def _top_level_split(arguments: str) -> list[str]:
    """``a: dict[str, int] = {}, b: str = ","`` -> the two arguments (commas inside brackets or quotes stay)."""
    parts, depth, quote, current = [], 0, "", ""
    for char in arguments:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += char
    parts.append(current.strip())
    return [part for part in parts if part not in ("", "*", "/")]


def test_the_reference_covers_the_trainer_and_the_checkpointing_hook() -> None:
    # A collection that found nothing would pass every case below.
    names = {cls.__name__ for cls in CLASSES if _own_constructor(cls)}
    assert {"BaseTrainer", "CheckpointingHook", "ValidationHook", "CheckpointStore"} <= names
    assert "max_steps: int" in _expected_parameters(trainfsm.BaseTrainer)
    assert _top_level_split('a: dict[str, int] = {"x": 1}, *, b: str = ",",') == [
        'a: dict[str, int] = {"x": 1}',
        'b: str = ","',
    ]
    assert 'path: Path | str = "checkpoints"' in _expected_parameters(trainfsm.CheckpointingHook)


@pytest.mark.slow
@needs_docs_extras
@pytest.mark.parametrize("cls", [cls for cls in CLASSES if _own_constructor(cls)], ids=lambda cls: cls.__name__)
def test_each_class_shows_its_constructor_with_types_and_defaults(site: Path, cls: type) -> None:
    shown = _rendered_signature(site, cls)
    assert shown.startswith(f"{cls.__name__}(") and shown.endswith(")"), shown
    arguments = _top_level_split(shown[len(cls.__name__) + 1 : -1])
    expected = _expected_parameters(cls)
    # In order, each exactly (for a default_factory: whatever follows "=").
    matches = len(arguments) == len(expected) and all(
        shown_one.startswith(wanted.removesuffix("<factory>")) if wanted.endswith("<factory>") else shown_one == wanted
        for shown_one, wanted in zip(arguments, expected, strict=True)
    )
    assert matches, f"{cls.__name__}'s reference signature shows {arguments}, its constructor takes {expected}"


@pytest.mark.slow
@needs_docs_extras
def test_no_internal_base_class_is_named(site: Path) -> None:
    for page in ("api", "hooks"):
        text = (site / "reference" / page / "index.html").read_text()
        assert "doc-class-bases" not in text and "Bases:" not in text, f"reference/{page} names a base class"


@pytest.mark.slow
@needs_docs_extras
def test_the_trainer_lists_what_a_subclass_implements_and_what_users_read(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text()
    methods = ("build_data_loader", "build_model", "build_optimizer", "build_lr_scheduler", "build_grad_scaler")
    for method in (*methods, "build_hooks", "forward", "train", "state_dict", "load_state_dict"):
        assert f'id="trainfsm.trainer.BaseTrainer.{method}"' in page, f"BaseTrainer.{method} has no entry"
    start = page.index('id="trainfsm.trainer.BaseTrainer"')
    entry = html.unescape(re.sub(r"<[^>]+>", "", page[start : page.index('id="trainfsm.trainer.BaseTrainer.')]))
    attributes = ("step", "epoch", "step_info", "exit_reason", "exit_code", "model", "optimizer", "workspace")
    for name in (*attributes, "rank", "world_size", "events", "hooks", "device", "unwrapped_model"):
        assert re.search(rf"\b{name}\b", entry.split("Attributes you read", 1)[-1]), f"{name} is not described"


# ---------------------------------------------------------------- the event reference
def _console_rows() -> dict[str, str]:
    """The event reference's "What the console prints" table: event -> its second cell."""
    page = _docs_hooks()._events_page()
    section = page.split("## What the console prints", 1)[1] if "## What the console prints" in page else ""
    return {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", section, flags=re.MULTILINE)}


@needs_docs_extras
def test_the_event_reference_shows_each_events_console_line() -> None:
    """Every event kind with a sentence shows it as the console prints it, rendered from the
    kind's example (a rank's own from rank 1: with its ``[rank 1]``); a sentence the console
    keeps to DEBUG says so; the others show at DEBUG only."""
    from trainfsm.trail import console, examples
    from trainfsm.trail.schema import EVENT_FIELDS
    from trainfsm.trail.sentences import SENTENCES

    rows = _console_rows()
    assert list(rows) == list(EVENT_FIELDS)
    for name, render in SENTENCES.items():
        if render is None:
            assert rows[name] == "DEBUG only: its fields, no sentence", name
            continue
        own = console.own(examples.example(name))
        line = console.sentence(examples.example(name, rank=1 if own else 0))
        assert line is not None and rows[name].startswith(f"`{line}`"), (name, rows[name])
        assert line.startswith("[rank 1] ") == own, line
        assert ("DEBUG only" in rows[name]) == (name in console.QUIET), rows[name]


# ---------------------------------------------------------------- offline
class _Loads(HTMLParser):
    """What a page makes the browser fetch by itself: scripts, styles, icons, images, frames."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "link" and values.get("rel") not in (None, "canonical", "alternate", "prev", "next"):
            self.urls.append((tag, values.get("href") or ""))
        elif tag in ("script", "img", "iframe", "source", "audio", "video", "embed") and values.get("src"):
            self.urls.append((tag, values["src"] or ""))


def _pages(site: Path) -> list[Path]:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10, f"only {len(pages)} pages under {site}"
    return pages


def _loads(page: Path) -> list[tuple[str, str]]:
    parser = _Loads()
    parser.feed(page.read_text())
    return parser.urls


def _resolve(site: Path, page: Path, url: str) -> Path:
    if url.startswith("/"):  # 404.html's links are from the site's root
        return site / url.lstrip("/")
    return Path(posixpath.normpath(str(page.parent / url.split("#")[0].split("?")[0])))


@pytest.mark.slow
@needs_docs_extras
def test_no_page_loads_anything_from_another_host(site: Path) -> None:
    remote = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
    found: dict[str, list[str]] = {}
    for page in _pages(site):
        text = page.read_text()
        urls = [f"<{tag}> {url}" for tag, url in _loads(page) if remote.match(url)]
        # and inline styles: a font or an image by url(), a stylesheet by @import
        urls += [f"style {url}" for url in re.findall(r"(?:url\(|@import\s+)['\"]?((?:https?:)?//[^)'\" ]+)", text)]
        for url in urls:
            found.setdefault(url, []).append(page.relative_to(site).as_posix())
    assert not found, "what pages would fetch from the network:\n" + "\n".join(
        f"{url}  ({len(pages)} pages: {pages[0]}, ...)" for url, pages in found.items()
    )


@pytest.mark.slow
@needs_docs_extras
def test_every_local_script_and_style_a_page_loads_is_in_the_site(site: Path) -> None:
    missing = []
    for page in _pages(site):
        for tag, url in _loads(page):
            if (tag == "script" or url.endswith((".css", ".js"))) and not _resolve(site, page, url).is_file():
                missing.append(f"{page.relative_to(site)}: <{tag}> {url}")
    assert not missing, "\n".join(missing)


@pytest.mark.slow
@needs_docs_extras
def test_pages_with_a_diagram_load_the_sites_own_mermaid(site: Path) -> None:
    script = site / MERMAID_JS
    assert script.is_file() and script.stat().st_size > 1_000_000, f"{MERMAID_JS} is missing or truncated"
    # Material fetches Mermaid from unpkg when `typeof mermaid == "undefined"`: this file defines it.
    assert b'globalThis["mermaid"]' in script.read_bytes()[-2000:], f"{MERMAID_JS} does not define mermaid"
    assert b"MIT License" in (site / "assets" / "javascripts" / "mermaid.LICENSE.txt").read_bytes()
    with_diagrams = [page for page in _pages(site) if 'class="mermaid"' in page.read_text()]
    assert any(page.relative_to(site).as_posix() == "guides/machine-and-hooks/index.html" for page in with_diagrams)
    for page in with_diagrams:
        scripts = [_resolve(site, page, url) for tag, url in _loads(page) if tag == "script"]
        assert script in scripts, f"{page.relative_to(site)} has a diagram but does not load {MERMAID_JS}"


@pytest.mark.slow
@needs_docs_extras
def test_search_runs_from_the_site(site: Path) -> None:
    assert (site / "search" / "search_index.json").is_file()
    page = site / "guides" / "getting-started" / "index.html"
    config = re.search(r'<script id="__config" type="application/json">(.*?)</script>', page.read_text())
    assert config, "no Material config on the page"
    worker = re.search(r'"search": "([^"]+)"', config.group(1))
    assert worker and not worker.group(1).startswith(("http", "//")), config.group(1)
    assert _resolve(site, page, worker.group(1)).is_file(), f"search worker {worker.group(1)} is not in the site"


def test_the_pinned_mermaid_is_the_major_version_material_asks_for() -> None:
    spec = importlib.util.find_spec("material")
    if spec is None or spec.origin is None:
        pytest.skip("mkdocs-material is not installed (the docs extra)")
    bundles = sorted(Path(spec.origin).parent.glob("templates/assets/javascripts/bundle.*.min.js"))
    assert bundles, "mkdocs-material's bundle was not found"
    asked = re.findall(rb"mermaid@(\d+)/dist/mermaid\.min\.js", bundles[0].read_bytes())
    assert asked, "mkdocs-material's bundle no longer names the Mermaid it loads; check MERMAID_VERSION by hand"
    pinned = _docs_hooks().MERMAID_VERSION
    assert {major.decode() for major in asked} == {pinned.split(".")[0]}, (
        f"mkdocs-material loads mermaid@{asked[0].decode()}, scripts/docs_hooks.py pins {pinned}: pin the newest "
        "release of that major version (MERMAID_VERSION and MERMAID_INTEGRITY)"
    )


@needs_docs_extras
def test_the_build_refuses_a_mermaid_that_does_not_match_its_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mkdocs.exceptions import PluginError

    hooks = _docs_hooks()
    monkeypatch.setattr(hooks, "MERMAID_CACHE", tmp_path / "mermaid.tgz")
    (tmp_path / "mermaid.tgz").write_bytes(b"a truncated download")  # not trusted: fetched again
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"not the release"))
    with pytest.raises(PluginError, match="does not match its pinned integrity"):
        hooks._mermaid_tarball()
    assert (tmp_path / "mermaid.tgz").read_bytes() == b"a truncated download"  # nothing cached

    def offline(url: str, timeout: float) -> None:
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(PluginError, match=r"could not download Mermaid .* holds no verified copy"):
        hooks._mermaid_tarball()
