"""Draw the training loop's state machine from the table the trainer runs (``trainfsm.machine``).

The drawing goes through transitions' own diagram support: the machine is built by
``machine.build_machine`` (the trainer's factory, so the same states, rows and options) with a
``GraphMachine`` class instead of the trainer's ``TrainMachine``. ``GraphMachine`` is only used here,
to draw: its triggers cost more than the trainer's compiled ones.

Formats:

- ``mermaid``: text, needs nothing beyond transitions (its ``graph_engine="mermaid"``).
- ``dot``: Graphviz source text, needs the ``graphviz`` Python package (not the ``dot`` program).
- ``svg`` / ``png``: rendered by Graphviz, needs the ``graphviz`` Python package and the ``dot``
  program (Debian/Ubuntu: ``apt-get install graphviz``; macOS: ``brew install graphviz``).

The output is a function of the table alone (no current state is highlighted, no timestamps), so
the committed files in ``diagrams/`` can be compared with what the code generates now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal

from trainfsm import machine as fsm

TITLE: Final = "trainfsm"
FORMATS: Final = ("mermaid", "dot", "svg", "png")
TEXT_FORMATS: Final = ("mermaid", "dot", "svg")

#: File suffix -> format, for ``trainfsm diagram -o PATH`` without ``--format``.
SUFFIXES: Final[dict[str, str]] = {
    ".mmd": "mermaid",
    ".mermaid": "mermaid",
    ".dot": "dot",
    ".gv": "dot",
    ".svg": "svg",
    ".png": "png",
}

_INSTALL_PACKAGE: Final = "pip install graphviz  (or: pip install 'trainfsm[diagrams]')"
_INSTALL_PROGRAM: Final = "on Debian/Ubuntu apt-get install graphviz, on macOS brew install graphviz"


class DiagramError(RuntimeError):
    """A diagram could not be drawn; the message says what to install or change."""


class _Model:
    """A bare model for the drawing machine: transitions attaches the triggers to it."""


def _graph(engine: Literal["graphviz", "mermaid"]) -> Any:
    """transitions' graph object for the table, with no state highlighted."""
    from transitions.extensions import GraphMachine

    class _DrawingMachine(GraphMachine):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(graph_engine=engine, title=TITLE, **kwargs)

    machine = fsm.build_machine(_Model(), machine_cls=_DrawingMachine)
    # A fresh graph object is unstyled; ``model.get_graph()`` would mark the model's current state
    # (BUILD) as active, which says something about one model, not about the table.
    return machine.graph_cls(machine).get_graph(title=TITLE)


def mermaid() -> str:
    """The machine as a Mermaid ``stateDiagram-v2``, ending in a newline."""
    source: str = _graph("mermaid").source
    lines = [line.rstrip() for line in source.splitlines()]
    # transitions writes the title as a bare front-matter line; Mermaid reads the front matter as
    # YAML and shows a title only under a `title:` key.
    if lines[:3] == ["---", TITLE, "---"]:
        lines[1] = f"title: {TITLE}"
    return "\n".join(lines) + "\n"


def _graphviz_graph() -> Any:
    try:
        import graphviz  # noqa: F401 - transitions' graphviz engine needs it
    except ImportError:
        raise DiagramError(
            f"the dot, svg and png formats need the `graphviz` Python package: {_INSTALL_PACKAGE}"
        ) from None
    return _graph("graphviz")


def dot() -> str:
    """The machine as Graphviz DOT source, ending in a newline."""
    source: str = _graphviz_graph().source
    return source if source.endswith("\n") else source + "\n"


def render(fmt: str) -> bytes:
    """The machine in ``fmt`` (one of ``FORMATS``) as bytes; text formats are UTF-8."""
    if fmt == "mermaid":
        return mermaid().encode()
    if fmt == "dot":
        return dot().encode()
    if fmt not in FORMATS:
        raise ValueError(f"unknown diagram format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    graph = _graphviz_graph()
    import graphviz

    try:
        data: bytes = graph.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise DiagramError(
            f"the {fmt} format needs Graphviz's `dot` program, which is not on PATH; {_INSTALL_PROGRAM}"
        ) from None
    except graphviz.CalledProcessError as exc:
        raise DiagramError(f"Graphviz's `dot` failed to render {fmt}: {exc}") from None
    return data


def format_for(path: Path | None, fmt: str | None) -> str:
    """The format to write: ``fmt`` if given, else the one ``path``'s suffix names, else mermaid."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown diagram format {fmt!r}; choose one of {', '.join(FORMATS)}.")
        return fmt
    if path is None:
        return "mermaid"
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"cannot tell the diagram format from {str(path)!r} (suffix {suffix or 'none'!r}); pass --format "
            f"({', '.join(FORMATS)}) or use one of the suffixes {', '.join(SUFFIXES)}."
        )
    return SUFFIXES[suffix]


def write(path: Path, fmt: str) -> None:
    """Render ``fmt`` and write it to ``path`` (parent directories are created)."""
    data = render(fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
