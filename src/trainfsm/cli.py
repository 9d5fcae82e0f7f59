"""The ``trainfsm`` command. Thin: parse arguments, call the library, map outcomes to exit codes.

Exit codes (every subcommand): 0 success; 1 failure (the run failed, or an optional dependency is
missing); 2 usage error or unreadable input. Subcommands import their heavier dependencies
(scikit-learn, graphviz) only when they run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from trainfsm import __version__, diagram

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2

EXIT_CODES_HELP: Final = """\
exit codes:
  0  success
  1  failure (the run failed, or an optional dependency is missing)
  2  usage error or unreadable input"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


DEMO_DESCRIPTION: Final = """\
Train a small MLP on scikit-learn's digits data set (it ships inside scikit-learn:
no download) on CPU in a few seconds. Checkpoints go to WORKSPACE/checkpoints, the
audit trail to WORKSPACE/logs/events.rank0.jsonl; at the end it prints the
validation accuracy and where those files are. Running it again on the same
workspace resumes from the latest checkpoint.

Needs the `demo` extra: pip install 'trainfsm[demo]'."""

DIAGRAM_DESCRIPTION: Final = """\
Draw the training loop's state machine from the table the trainer runs
(trainfsm.machine). mermaid needs nothing more; dot needs the `graphviz` Python
package; svg and png also need Graphviz's `dot` program (apt-get install graphviz).
Without -o, text formats go to standard output. Without --format, the suffix of
-o picks it (.mmd, .dot, .svg, .png), else mermaid.

The committed files in diagrams/ are made with:
  trainfsm diagram --format mermaid -o diagrams/machine.mmd
  trainfsm diagram --format dot -o diagrams/machine.dot"""


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

    demo_parser = commands.add_parser(
        "demo",
        help="train a small MLP on scikit-learn's digits (CPU, seconds), with checkpoints and an audit trail",
        description=DEMO_DESCRIPTION,
        epilog=EXIT_CODES_HELP,
        formatter_class=raw,
    )
    add = demo_parser.add_argument
    add("--workspace", type=Path, default=Path("runs/demo"), metavar="DIR", help="run directory (default: runs/demo)")
    add("--steps", type=_positive_int, default=300, metavar="N", help="optimizer steps in all (default: 300)")
    add("--log-every", type=_positive_int, default=50, metavar="N", help="a progress line every N steps (default: 50)")
    add("--checkpoint-every", type=_positive_int, default=100, metavar="N", help="checkpoint interval (default: 100)")
    add("-v", "--verbose", action="store_true", help="also print every transition (DEBUG)")
    demo_parser.set_defaults(run=_demo)

    diagram_parser = commands.add_parser(
        "diagram",
        help="draw the state machine from the table the trainer runs",
        description=DIAGRAM_DESCRIPTION,
        epilog=EXIT_CODES_HELP,
        formatter_class=raw,
    )
    add = diagram_parser.add_argument
    add("--format", choices=diagram.FORMATS, help="output format (default: from -o's suffix, else mermaid)")
    add("-o", "--output", type=Path, metavar="PATH", help="write to PATH instead of standard output")
    diagram_parser.set_defaults(run=_diagram)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainfsm`` console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits with 2 on a usage error
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code: int = args.run(args, parser)
    except KeyboardInterrupt:
        print("trainfsm: interrupted", file=sys.stderr)
        return 130
    return code


def _error(command: str, message: str) -> None:
    print(f"trainfsm {command}: error: {message}", file=sys.stderr)


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # The one place that configures logging: an application's entry point, not the library.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    from trainfsm import demo

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


def _diagram(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
