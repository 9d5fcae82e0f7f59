"""The ``trainfsm`` command. Thin: parse arguments, call the library, map outcomes to exit codes.

Exit codes (every subcommand): 0 success; 1 failure (the run did not end well, the checkpoint is
invalid, or an optional dependency is missing); 2 usage error or unreadable input; 3 (``audit``,
``trace``) the trail is inconsistent with the machine, which wins over 1; 130 interrupted (Ctrl-C).
Each subcommand's help lists its own; the long help texts are in ``cli_help``. Subcommands import
their heavier dependencies (torch for ``demo`` and ``inspect``, scikit-learn, graphviz, matplotlib)
only when they run: ``audit``, ``trace``, ``plot`` and ``diagram`` never import torch, so they start
in ~0.2 s rather than ~2.5 s (``tests/test_cli_startup.py``). The work is done by the modules beside
it in ``trainfsm.tools`` (``audit``, ``trace``, ``plot``, ``inspect_checkpoint``, ``diagram``, ``demo``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from trainfsm import __version__
from trainfsm.tools import diagram
from trainfsm.tools.cli_help import (
    AUDIT_DESCRIPTION,
    AUDIT_EXIT_CODES,
    DEMO_DESCRIPTION,
    DIAGRAM_DESCRIPTION,
    EXIT_CODES_HELP,
    INSPECT_DESCRIPTION,
    INSPECT_EXIT_CODES,
    PLOT_DESCRIPTION,
    PLOT_EXIT_CODES,
    TRACE_DESCRIPTION,
    TRACE_EXIT_CODES,
)

if TYPE_CHECKING:
    from trainfsm.tools.report import AuditReport

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INCONSISTENT: Final = 3

TRAIL_HELP: Final = "a run directory (workspace) or events.rank*.jsonl files"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive(text: str) -> int:
    """``audit --jobs``: as ``_positive_int``, in the words its error has always used."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="trainfsm",
        description="A PyTorch training loop whose control flow is an explicit, audited state machine.",
        epilog=EXIT_CODES_HELP,
        formatter_class=raw,
    )
    parser.add_argument("--version", action="version", version=f"trainfsm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def subcommand(
        name: str, run: Callable[[argparse.Namespace], int], summary: str, description: str, epilog: str
    ) -> Callable[..., Any]:
        """Add a subcommand (``summary`` is its line in ``trainfsm --help``); returns its ``add_argument``."""
        sub = commands.add_parser(name, help=summary, description=description, epilog=epilog, formatter_class=raw)
        sub.set_defaults(run=run)
        return sub.add_argument

    summary = "train a small MLP on scikit-learn's digits (CPU, seconds), with checkpoints and an audit trail"
    add = subcommand("demo", _demo, summary, DEMO_DESCRIPTION, EXIT_CODES_HELP)
    add("--workspace", type=Path, default=Path("runs/demo"), metavar="DIR", help="run directory (default: runs/demo)")
    add("--steps", type=_positive_int, default=300, metavar="N", help="optimizer steps in all (default: 300)")
    add("--log-every", type=_positive_int, default=50, metavar="N", help="a progress line every N steps (default: 50)")
    add("--checkpoint-every", type=_positive_int, default=100, metavar="N", help="checkpoint interval (default: 100)")
    add("-v", "--verbose", action="store_true", help="also print every transition (DEBUG)")

    summary = "draw the state machine from the table the trainer runs"
    add = subcommand("diagram", _diagram, summary, DIAGRAM_DESCRIPTION, EXIT_CODES_HELP)
    add("--format", choices=diagram.FORMATS, help="output format (default: from -o's suffix, else mermaid)")
    add("-o", "--output", type=Path, metavar="PATH", help="write to PATH instead of standard output")

    # The commands that read what a run left behind: its audit trail and its checkpoints.
    summary = "replay a run's audit trail against the machine and report attempts, steps and problems"
    add = subcommand("audit", _audit, summary, AUDIT_DESCRIPTION, AUDIT_EXIT_CODES)
    add("inputs", nargs="+", type=Path, metavar="RUN_DIR_OR_EVENTS", help=TRAIL_HELP)
    add("--json", action="store_true", help="print the report as JSON (trainfsm.audit/1)")
    jobs_help = "processes replaying rank files side by side (default: one per core, for trails over 32 MiB)"
    add("--jobs", type=_positive, default=None, metavar="N", help=jobs_help)

    summary = "the story of each failed, interrupted, preempted or killed attempt: last events, what came next"
    add = subcommand("trace", _trace, summary, TRACE_DESCRIPTION, TRACE_EXIT_CODES)
    add("inputs", nargs="+", type=Path, metavar="RUN_DIR", help=TRAIL_HELP)
    add("-n", "--events", type=_positive_int, default=10, metavar="N", help="events shown per rank (default: 10)")

    summary = "draw the run: states per rank over time, checkpoints, retries, signals, restarts"
    add = subcommand("plot", _plot, summary, PLOT_DESCRIPTION, PLOT_EXIT_CODES)
    add("inputs", nargs="+", type=Path, metavar="RUN_DIR", help=TRAIL_HELP)
    add("-o", "--output", type=Path, default=Path("run.png"), metavar="PATH", help="image to write (default: run.png)")
    add("--title", help="the figure's title (default: the run directory)")

    summary = "verify a checkpoint's manifest and checksums and print what is inside"
    add = subcommand("inspect", _inspect, summary, INSPECT_DESCRIPTION, INSPECT_EXIT_CODES)
    add("checkpoint", type=Path, metavar="CHECKPOINT_DIR")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainfsm`` console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits with 2 on a usage error
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        print("trainfsm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `trainfsm audit ... | head`: the reader left; say nothing more
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        return EXIT_OK
    except _trail_error() as exc:  # audit, trace, plot: an unreadable trail is a usage error
        _error(args.command, str(exc))
        return EXIT_USAGE
    return code


def _trail_error() -> type[Exception]:
    """``TrailError``, raised by ``audit``, ``trace`` and ``plot`` on an unreadable trail. An ``except``
    clause evaluates its expression only when an exception reaches it: ``trainfsm.trail.reader`` (~50 ms)
    is imported then, not on every start."""
    from trainfsm.trail.reader import TrailError

    return TrailError


def _error(command: str, message: str) -> None:
    print(f"trainfsm {command}: error: {message}", file=sys.stderr)


def _demo(args: argparse.Namespace) -> int:
    # The one place that configures logging: an application's entry point, not the library.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    from trainfsm.tools import demo

    try:
        result = demo.run(
            args.workspace,
            args.steps,
            log_every=args.log_every,
            checkpoint_every=args.checkpoint_every,
        )
    except demo.DemoError as exc:
        _error("demo", str(exc))
        return EXIT_FAILURE
    except Exception as exc:
        traceback.print_exc()
        _error("demo", f"training failed: {type(exc).__name__}: {exc}")
        events = args.workspace / "logs" / "events.rank0.jsonl"
        if events.exists():
            print(f"The audit trail of the failed run is in {events.resolve()}", file=sys.stderr)
        return EXIT_FAILURE
    print(demo.summary(result))
    return EXIT_OK


def _diagram(args: argparse.Namespace) -> int:
    try:
        fmt = diagram.format_for(args.output, args.format)
    except ValueError as exc:
        _error("diagram", str(exc))
        return EXIT_USAGE
    if fmt == "png" and args.output is None:
        _error("diagram", "png is binary: pass -o PATH to write it to a file.")
        return EXIT_USAGE
    try:
        if args.output is None:
            sys.stdout.write(diagram.render(fmt).decode())
        else:
            diagram.write(args.output, fmt)
    except diagram.DiagramError as exc:
        _error("diagram", str(exc))
        return EXIT_FAILURE
    except OSError as exc:
        _error("diagram", f"cannot write {args.output}: {exc}")
        return EXIT_FAILURE
    return EXIT_OK


def _audit(args: argparse.Namespace) -> int:
    from trainfsm.tools import audit

    report = audit.audit(args.inputs, jobs=args.jobs)
    print(report.to_json() if args.json else audit.render(report))
    return _verdict_code(report)


def _verdict_code(report: AuditReport) -> int:
    """``audit`` and ``trace``: 3 inconsistent trail (first: then the run's story is unreliable),
    1 a consistent trail of a run that did not end well, 0 both fine."""
    if not report.consistent:
        return EXIT_INCONSISTENT
    return EXIT_OK if report.ended_well else EXIT_FAILURE


def _trace(args: argparse.Namespace) -> int:
    from trainfsm.tools import trace

    report = trace.trace(args.inputs, events=args.events)
    print(trace.render(report))
    return _verdict_code(report.audit)


def _plot(args: argparse.Namespace) -> int:
    from trainfsm.tools import plot

    title = args.title or ", ".join(str(path) for path in args.inputs)
    try:
        result = plot.plot(args.inputs, args.output, title=title)
    except plot.PlotError as exc:
        _error("plot", str(exc))
        return EXIT_FAILURE
    except OSError as exc:
        _error("plot", f"cannot write {args.output}: {exc}")
        return EXIT_FAILURE
    for note in result.notes:
        print(f"note: {note.where()}: {note.message}", file=sys.stderr)
    print(plot.summary(result))
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from trainfsm.checkpoint.store import CheckpointError
    from trainfsm.tools import inspect_checkpoint

    try:
        found = inspect_checkpoint.inspect(args.checkpoint)
    except inspect_checkpoint.CheckpointNotFound as exc:
        _error("inspect", str(exc))
        return EXIT_USAGE
    except CheckpointError as exc:
        _error("inspect", f"INVALID: {exc}")
        return EXIT_FAILURE
    print(inspect_checkpoint.render(found))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
