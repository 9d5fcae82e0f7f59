"""The committed diagrams are what the code draws now, and ``trainfsm diagram`` behaves as documented."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from trainfsm.machine import STATES, TRANSITIONS
from trainfsm.tools import diagram
from trainfsm.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
MERMAID = ROOT / "diagrams" / "machine.mmd"
DOT = ROOT / "diagrams" / "machine.dot"


def _stale(path: Path, fmt: str) -> str:
    rel = path.relative_to(ROOT)
    return (
        f"{rel} differs from what trainfsm.machine's table draws now. Regenerate it and commit the result:\n"
        f"    trainfsm diagram --format {fmt} -o {rel}\n"
        f"(or `make diagrams`; the README's ```mermaid block must match diagrams/machine.mmd too)."
    )


def test_committed_mermaid_is_current() -> None:
    assert MERMAID.read_text() == diagram.mermaid(), _stale(MERMAID, "mermaid")


def test_committed_dot_is_current() -> None:
    pytest.importorskip("graphviz", reason="the dot format needs the graphviz package (in the dev extra)")
    assert DOT.read_text() == diagram.dot(), _stale(DOT, "dot")


def test_readme_embeds_the_committed_mermaid_diagram() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```mermaid\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "README.md has no ```mermaid block"
    assert blocks[0] == MERMAID.read_text(), (
        "README.md's ```mermaid block differs from diagrams/machine.mmd; paste the file's content into it "
        "(`make diagrams` regenerates the file)."
    )


def test_mermaid_is_deterministic_and_draws_every_row() -> None:
    text = diagram.mermaid()
    assert text == diagram.mermaid()
    assert text.endswith("\n") and not any(line != line.rstrip() for line in text.splitlines())
    assert not re.search(r"Class \w+ s_(active|previous)", text), "no state may be highlighted"
    edges = {}
    for source, dest, labels in re.findall(r"^\s*(\w+) --> (\w+): (.*)$", text, flags=re.MULTILINE):
        edges[(source, dest)] = labels.split(" | ")
    expected: dict[tuple[str, str], list[str]] = {}
    for trigger, sources, dest in TRANSITIONS:
        for source in sources:
            expected.setdefault((source, dest), []).append(trigger)
    assert {key: sorted(value) for key, value in edges.items()} == {
        key: sorted(value) for key, value in expected.items()
    }
    for state in STATES:
        assert f'state "{state}" as {state}' in text
    assert "[*] --> BUILD" in text


def test_cli_prints_mermaid_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram"]) == 0
    assert capsys.readouterr().out == diagram.mermaid()


def test_cli_writes_the_format_named_by_the_suffix(tmp_path: Path) -> None:
    assert main(["diagram", "-o", str(tmp_path / "sub" / "m.mmd")]) == 0
    assert (tmp_path / "sub" / "m.mmd").read_text() == diagram.mermaid()


@pytest.mark.parametrize(
    "argv",
    [
        ["diagram", "-o", "machine.txt"],  # unknown suffix, no --format
        ["diagram", "--format", "png"],  # binary to standard output
    ],
)
def test_cli_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "trainfsm diagram: error:" in capsys.readouterr().err


def test_cli_unknown_format_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["diagram", "--format", "jpeg"])
    assert exit_info.value.code == 2


@pytest.mark.skipif(
    shutil.which("dot") is None and not os.environ.get("TRAINFSM_REQUIRE_DOT"),
    reason="Graphviz's dot program is not installed (CI installs it and sets TRAINFSM_REQUIRE_DOT=1)",
)
def test_svg_renders_with_graphviz(tmp_path: Path) -> None:
    pytest.importorskip("graphviz")
    out = tmp_path / "machine.svg"
    assert main(["diagram", "-o", str(out)]) == 0
    svg = out.read_text()
    assert "<svg" in svg and all(state in svg for state in STATES)


def test_svg_without_dot_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("graphviz")
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    with pytest.raises(diagram.DiagramError, match="apt-get install graphviz"):
        diagram.render("svg")
