"""The ``trainfsm`` command's long help: each subcommand's description and exit codes.

Text only, apart from ``trainfsm.tools.cli`` so that the command's code reads in one sitting. argparse
prints these as written (``RawDescriptionHelpFormatter``): line breaks and indentation are the help's.
"""

from __future__ import annotations

from typing import Final

EXIT_CODES_HELP: Final = """\
exit codes:
  0    success
  1    failure: the run failed or did not end well (demo, audit, trace), the
       checkpoint is invalid (inspect), or an optional dependency is missing;
       see each command's help
  2    usage error or unreadable input
  3    audit, trace: the trail is inconsistent with the machine (wins over 1)
  130  interrupted (Ctrl-C)"""

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
checkpoints, retries, signals, exceptions, stalls and restarts marked; below
it, loss and learning-rate curves when the trail has them (LoggingHook's
`metrics` events; without them the timeline is drawn alone, and the command
says so).

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
torch.load(weights_only=True) only after they verified. A checkpoint that
trainloop wrote has no manifest, so nothing to verify: its files are loaded the
same way and listed, with what a resume from it lacks (random state, data
position)."""

INSPECT_EXIT_CODES: Final = """\
exit codes:
  0  the checkpoint is intact (trainloop's: it loads, and trainfsm can resume
     from it)
  1  it is not: incomplete, truncated, corrupted, or unloadable (the problem is
     printed)
  2  usage error, or no checkpoint at that path"""
