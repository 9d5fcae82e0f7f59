"""The ``trainfsm`` command. Thin: parse arguments, call the library, map outcomes to exit codes.

Exit codes (every subcommand): 0 success; 1 failure (the run did not end well, the checkpoint is
invalid, or an optional dependency is missing); 2 usage error or unreadable input; 3 (``audit``,
``trace``) the trail is inconsistent with the machine, which wins over 1; 130 interrupted (Ctrl-C).
Each subcommand's help lists its own. Subcommands import their heavier dependencies (torch for
``demo`` and ``inspect``, scikit-learn, graphviz, matplotlib) only when they run: ``audit``,
``trace``, ``plot`` and ``diagram`` never import torch, so they start in ~0.2 s rather than ~2.5 s
(``tests/test_cli_startup.py``). The work is done by the modules beside it in ``trainfsm.tools``
(``audit``, ``trace``, ``plot``, ``inspect_checkpoint``, ``diagram``, ``demo``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from trainfsm import __version__
from trainfsm.tools import diagram

if TYPE_CHECKING:
    from trainfsm.tools.report import AuditReport

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INCONSISTENT: Final = 3

EXIT_CODES_HELP: Final = """\
exit codes:
  0    success
  1    failure: the run failed or did not end well (demo, audit, trace), the
       checkpoint is invalid (inspect), or an optional dependency is missing;
       see each command's help
  2    usage error or unreadable input
  3    audit, trace: the trail is inconsistent with the machine (wins over 1)
  130  interrupted (Ctrl-C)"""


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
    _add_trail_commands(commands, raw)
    return parser


AUDIT_DESCRIPTION: Final = """\
Replay a run's audit trail against the machine's table and report what happened:
per attempt (a launch or a restart) whether it resumed, the steps done,
micro-batches, non-finite retries, checkpoints saved/loaded/skipped, signals
(which, when, the step all ranks agreed on) and the exit reason and code.

It checks every transition (each attempt starts in BUILD; a transition's source
must be the current state and (trigger, source, dest) a row of the table), that
step numbers rise by exactly one from the restored checkpoint's step + 1, and
that the ranks of an attempt agree. Apart from that, it says whether the run
ended well: its last attempt did not fail, was not interrupted (Ctrl-C) or
killed (no exit event: reported at its last record), and was requeued if it
asked to be. An earlier attempt that was killed or failed is no run problem
when a later attempt resumed. Problems are listed with FILE:LINE.

Give a run directory (its logs/events.rank*.jsonl are read: all ranks) or event
files. A cut-off last line (a killed writer) is noted and tolerated. --json
prints the report as one JSON object, schema trainfsm.audit/1 (documented in
the trainfsm.tools.report module)."""

AUDIT_EXIT_CODES: Final = """\
exit codes:
  0  the trail is consistent and the run ended well
  1  the trail is consistent, but the run did not end well: its last attempt
     failed, was interrupted or killed, or its requeue was refused
  2  usage error, or unreadable input: a missing or empty file, a line that is
     not a JSON event, events of an unknown format version (FILE:LINE named)
  3  the trail is inconsistent with the machine: an illegal transition, a state
     mismatch, a step gap, ranks that disagree, events out of order (each
     listed with FILE:LINE); 3 wins over 1"""

TRACE_DESCRIPTION: Final = """\
The failure story of a run: for each failed, interrupted, preempted or killed
attempt, the last N events on each rank before the end, the state and step
where the trail ends, every exception with its traceback, and what the next
attempt did (resumed from which checkpoint, or started afresh). It ends with
the audit's verdict: is the trail consistent, did the run end well."""

TRACE_EXIT_CODES: Final = """\
exit codes:
  0  the story was told, the trail is consistent and the run ended well (a
     failed or killed attempt that a later one resumed included)
  1  the trail is consistent, but the run did not end well (as for audit)
  2  usage error, or unreadable input (the file and line are named)
  3  the trail is inconsistent with the machine (as for audit); 3 wins over 1"""

PLOT_DESCRIPTION: Final = """\
Draw the run: one band per rank over wall-clock time, coloured by state, with
checkpoints, retries, signals, exceptions and restarts marked; below it, loss
and learning-rate curves when the trail has them (it records none today: the
timeline is then drawn alone, and the command says so).

Needs matplotlib: pip install 'trainfsm[plot]'."""

PLOT_EXIT_CODES: Final = """\
exit codes:
  0  the picture was written
  1  matplotlib is missing, or the output cannot be written
  2  usage error, or unreadable input (the file and line are named)"""

INSPECT_DESCRIPTION: Final = """\
Verify a checkpoint (its manifest, the files it lists, their sizes and
checksums) and print what is inside: files and sizes, step, the versions that
wrote it, the model's parameter names, shapes and dtypes, the optimizer's state
and param groups, scheduler and grad-scaler keys, and hooks' state.

CHECKPOINT_DIR is a checkpoint (checkpoints/1000), a checkpoint store (its
`latest`), or a workspace (its checkpoints/latest). Files are loaded with
torch.load(weights_only=True) only after they verified."""

INSPECT_EXIT_CODES: Final = """\
exit codes:
  0  the checkpoint is intact
  1  it is not: incomplete, truncated, corrupted, or unloadable (the problem is
     printed)
  2  usage error, or no checkpoint at that path"""


def _add_trail_commands(commands: Any, raw: type[argparse.HelpFormatter]) -> None:
    """The commands that read what a run left behind: its audit trail and its checkpoints."""
    trail_help = "a run directory (workspace) or events.rank*.jsonl files"
    audit_parser = commands.add_parser(
        "audit",
        help="replay a run's audit trail against the machine and report attempts, steps and problems",
        description=AUDIT_DESCRIPTION,
        epilog=AUDIT_EXIT_CODES,
        formatter_class=raw,
    )
    audit_parser.add_argument("inputs", nargs="+", type=Path, metavar="RUN_DIR_OR_EVENTS", help=trail_help)
    audit_parser.add_argument("--json", action="store_true", help="print the report as JSON (trainfsm.audit/1)")
    audit_parser.add_argument(
        "--jobs",
        type=_positive,
        default=None,
        metavar="N",
        help="processes replaying rank files side by side (default: one per core, for trails over 32 MiB)",
    )
    audit_parser.set_defaults(run=_audit)

    trace_parser = commands.add_parser(
        "trace",
        help="the story of each failed, interrupted, preempted or killed attempt: last events, what came next",
        description=TRACE_DESCRIPTION,
        epilog=TRACE_EXIT_CODES,
        formatter_class=raw,
    )
    trace_parser.add_argument("inputs", nargs="+", type=Path, metavar="RUN_DIR", help=trail_help)
    trace_parser.add_argument(
        "-n", "--events", type=_positive_int, default=10, metavar="N", help="events shown per rank (default: 10)"
    )
    trace_parser.set_defaults(run=_trace)

    plot_parser = commands.add_parser(
        "plot",
        help="draw the run: states per rank over time, checkpoints, retries, signals, restarts",
        description=PLOT_DESCRIPTION,
        epilog=PLOT_EXIT_CODES,
        formatter_class=raw,
    )
    plot_parser.add_argument("inputs", nargs="+", type=Path, metavar="RUN_DIR", help=trail_help)
    plot_parser.add_argument(
        "-o", "--output", type=Path, default=Path("run.png"), metavar="PATH", help="image to write (default: run.png)"
    )
    plot_parser.add_argument("--title", help="the figure's title (default: the run directory)")
    plot_parser.set_defaults(run=_plot)

    inspect_parser = commands.add_parser(
        "inspect",
        help="verify a checkpoint's manifest and checksums and print what is inside",
        description=INSPECT_DESCRIPTION,
        epilog=INSPECT_EXIT_CODES,
        formatter_class=raw,
    )
    inspect_parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR")
    inspect_parser.set_defaults(run=_inspect)


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
    except BrokenPipeError:  # `trainfsm audit ... | head`: the reader left; say nothing more
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        return EXIT_OK
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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _audit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainfsm.tools import audit
    from trainfsm.trail import TrailError

    try:
        report = audit.audit(args.inputs, jobs=args.jobs)
    except TrailError as exc:
        _error("audit", str(exc))
        return EXIT_USAGE
    print(report.to_json() if args.json else audit.render(report))
    return _verdict_code(report)


def _verdict_code(report: AuditReport) -> int:
    """``audit`` and ``trace``: 3 inconsistent trail (first: then the run's story is unreliable),
    1 a consistent trail of a run that did not end well, 0 both fine."""
    if not report.consistent:
        return EXIT_INCONSISTENT
    return EXIT_OK if report.ended_well else EXIT_FAILURE


def _trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainfsm.tools import trace
    from trainfsm.trail import TrailError

    try:
        report = trace.trace(args.inputs, events=args.events)
    except TrailError as exc:
        _error("trace", str(exc))
        return EXIT_USAGE
    print(trace.render(report))
    return _verdict_code(report.audit)


def _plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainfsm.tools import plot
    from trainfsm.trail import TrailError

    title = args.title or ", ".join(str(path) for path in args.inputs)
    try:
        result = plot.plot(args.inputs, args.output, title=title)
    except TrailError as exc:
        _error("plot", str(exc))
        return EXIT_USAGE
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


def _inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainfsm.checkpoint import CheckpointError
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
