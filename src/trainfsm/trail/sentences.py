"""What the console says of each event: one sentence a person reads, beside the schema.

``SENTENCES`` maps every event of ``trainfsm.trail.schema.EVENT_FIELDS`` to a function of the
event that returns its sentence, or None where the event is the trail's alone (the console shows
its fields at DEBUG only): ``tests/test_sentences.py`` renders every kind and fails on one missing,
from the examples of ``trainfsm.trail.examples`` (which the event reference shows too).
A sentence has no dicts and no checksums, and reads sizes and times in MB, ms and s; the full
event is in the trail. Which rank speaks, at which level, is ``trainfsm.trail.console``'s.
No torch and no structlog here.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

Event = Mapping[str, Any]


def size(n: Any) -> str:
    """Bytes as people read them: ``89 kB``, ``1.3 MB``, ``2.41 GB``."""
    if not isinstance(n, int | float):
        return "? MB"
    if n < 1e6:
        return f"{n / 1e3:.0f} kB"
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def duration(seconds: Any) -> str:
    """``4.8 ms``, ``120 ms``, ``3.2 s``, ``12 min``."""
    if not isinstance(seconds, int | float):
        return "? s"
    if seconds < 0.01:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def clock(epoch: Any) -> str:
    """Epoch seconds as the local time of day."""
    return time.strftime("%H:%M:%S", time.localtime(epoch)) if isinstance(epoch, int | float) else "?"


def path(name: Any, room: int = 48) -> str:
    """A path relative to the working directory when under it, its tail when longer than ``room``."""
    text = str(name)
    if os.path.isabs(text):
        relative = os.path.relpath(text)
        if not relative.startswith(".."):
            text = relative
    if len(text) <= room:
        return text
    tail = text[-(room - 4) :]
    return ".../" + (tail.split("/", 1)[1] if "/" in tail[1:] else tail)


def ending_in_path(head: str, name: Any, tail: str = "", width: int = 96) -> str:
    """``head: PATH tail.``, the path's tail only where the whole would pass ``width``."""
    return f"{head}: {path(name, max(12, width - len(head) - len(tail) - 3))}{tail}."


def first_line(text: Any, room: int = 80) -> str:
    """Free text (an error's message) in one line of ``room`` at most, with no checksum in it."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    line = re.sub(r"\b[0-9a-f]{16,}\b", "...", line)
    return line if len(line) <= room else line[: room - 3] + "..."


def plural(n: Any, word: str) -> str:
    """``1 batch``, ``2 batches``, ``3 epochs``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith(('tch', 'sh', 's', 'x')) else 's'}"


# ---------------------------------------------------------------- starting and resuming
def _run_start(e: Event) -> str:
    versions = e.get("versions") or {}
    return (
        f"Run {e.get('run_id')} attempt {e.get('attempt')}: {plural(e.get('world_size'), 'rank')}, "
        f"{e.get('max_steps')} steps (trainfsm {versions.get('trainfsm')}, torch {versions.get('torch')})."
    )


def _restore(e: Event) -> str | None:
    if e.get("resumed"):
        return None  # ``checkpoint_loaded`` said it
    return f"Starting fresh at step {e.get('from_step')} (run {e.get('run_id')}, attempt {e.get('attempt')})."


def _checkpoint_loaded(e: Event) -> str:
    if e.get("format") == "trainloop":
        head = f"Resuming from trainloop's checkpoint {e.get('from_step')} (no data position or RNG)"
    else:
        head = f"Resuming from checkpoint {e.get('from_step')} (attempt {e.get('attempt')})"
    return ending_in_path(head, e.get("path"))


def _data_resumed(e: Event) -> str:
    how = {"state": "from the loader's state", "sampler": "skipped at the sampler", "skip": "drawn and skipped"}
    mode = e.get("mode")
    if mode == "none":
        return f"The data starts a new pass (data_resume='none'): {first_line(e.get('why'), 50)}."
    text = (
        f"The data resumes in epoch {e.get('epoch')} after {plural(e.get('batches'), 'batch')} "
        f"({how.get(str(mode), str(mode))}, {duration(e.get('seconds'))})"
    )
    if e.get("exact") is False:
        text += f", approximately: {first_line(e.get('approximate'), 40)}"
    return text + "."


def _data_exhausted(e: Event) -> str:
    dropped = e.get("dropped_micro_batches")
    text = f"The data is used up after {plural(e.get('epochs'), 'epoch')} (max_epochs): the run ends"
    return text + (f", {plural(dropped, 'micro-batch')} unstepped." if dropped else ".")


# ---------------------------------------------------------------- the step
def _non_finite(e: Event) -> str:
    step = e.get("step")
    if e.get("what") == "scaler_skip":
        return f"fp16 overflow at step {step}: its optimizer step skipped, the loss scale lowered ({e.get('scale')})."
    return f"Non-finite gradients at step {step}: running the step again (retry {e.get('retry')} of {e.get('max')})."


def _oom(e: Event) -> str:
    where = f"{e.get('phase')}, {e.get('rows')} rows" if e.get("phase") else "on another rank"
    ranks = e.get("ranks")
    if ranks:
        where += f", {'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
    return (
        f"Out of memory at step {e.get('step')} ({where}): retry {e.get('retry')} of {e.get('max')} "
        f"in pieces of {e.get('piece_rows')} rows."
    )


def _loss_none(e: Event) -> str:
    return f"loss=None at step {e.get('step')}, micro-batch {e.get('micro')}: every rank skips it."


# ---------------------------------------------------------------- checkpoints
def _checkpoint_saved(e: Event) -> str:
    how = f"{size(e.get('bytes'))} in {duration(e.get('seconds'))}"
    if e.get("asynchronous"):
        how += f", {duration(e.get('blocked_seconds'))} blocking"
    if e.get("sharded"):
        how += f", {plural(e.get('world_size'), 'rank')}"
    kept = " (kept)" if e.get("kept") else ""
    pruned = e.get("pruned")  # the console's (``trainfsm.trail.console.CONSOLE_ONLY``), not the trail's
    tail = f"; removed {', '.join(os.path.basename(p) for p in pruned)}" if pruned else ""
    return ending_in_path(f"Saved checkpoint {e.get('saved_step')}{kept} ({how})", e.get("path"), tail)


def _checkpoint_pruned(e: Event) -> str:
    return f"Removed old checkpoints: {', '.join(path(p, 40) for p in e.get('paths') or ())}."


def _checkpoint_failed(e: Event) -> str:
    return f"A background checkpoint save failed: {e.get('type')}: {first_line(e.get('message'), 60)}"


def _checkpoint_skipped(e: Event) -> str:
    return f"Skipped checkpoint {path(e.get('path'), 36)}: {first_line(e.get('reason'), 50)}"


def _checkpoint_not_newest(e: Event) -> str:
    return (
        f"Resumed from step {e.get('from_step')} though checkpoint {e.get('newest_step')} is newer: "
        "its steps are trained again."
    )


def _checkpoint_foreign(e: Event) -> str:
    found = e.get("found") or {}
    names = ", ".join(f"{name} ({who})" for name, who in list(found.items())[:3])
    return f"Checkpoints trainfsm did not write, never replaced or pruned: {names}."


def _names(what: str) -> Callable[[Event], str]:
    return lambda e: f"{what}: {', '.join(map(str, e.get('names') or ()))}."


# ---------------------------------------------------------------- leaving: signals, SLURM, the exit
def _signal_received(e: Event) -> str:
    return f"Received {e.get('signal')} at step {e.get('at_step')} ({e.get('at_state')})."


def _signal_agreed(e: Event) -> str:
    why = {
        "deadline": "before the job's time limit",
        "preemption": "SLURM preempted the job",
    }.get(str(e.get("reason")), str(e.get("signal")))
    return f"Stopping at step {e.get('agreed_step')} ({why}): a checkpoint, then exit."


def _deadline(e: Event) -> str:
    return (
        f"The job ends at {clock(e.get('end_time'))}, in {duration(e.get('left'))}; the way out needs "
        f"{duration(e.get('needed'))} (a save of {duration(e.get('save_seconds'))}): leaving now."
    )


def _job_end(e: Event) -> str:
    return f"SLURM may kill the job from {clock(e.get('kill_at'))} ({e.get('applied')}); job {e.get('job_state')}."


def _preempted(e: Event) -> str:
    return (
        f"SLURM preempted the job at {clock(e.get('preempt_time'))} (grace time "
        f"{duration(e.get('grace_time'))}, until {clock(e.get('grace_end'))}): leaving."
    )


def _requeue(e: Event) -> str:
    if e.get("requeued_by") == "slurm":
        return "SLURM requeued the job itself: the next attempt resumes from this checkpoint."
    if e.get("ok"):
        return "Requeued the job (scontrol requeue): the next attempt resumes from this checkpoint."
    return f"The job was not requeued: {first_line(e.get('message'), 60)}"


def _exit(e: Event) -> str:
    reason, code, step = e.get("reason"), e.get("code"), e.get("step")
    if reason == "completed":
        return f"Done: completed at step {step} (exit code {code})."
    resume = " Run it again to resume." if reason in ("preempted", "stalled", "interrupted") else ""
    return f"Exiting at step {step}: {reason} (exit code {code}).{resume}"


def _exception(e: Event) -> str:
    return f"{e.get('type')} at step {e.get('step')} ({e.get('state')}): {first_line(e.get('message'), 70)}"


def _collective_failed(e: Event) -> str:
    note = str(e.get("note") or "").removeprefix("trainfsm: ")
    return first_line(note.split(". ")[0], 90) + "."


# ---------------------------------------------------------------- stalls
def _stall(e: Event) -> str:
    doing = e.get("doing")
    if doing:
        where = re.split(r", (?:in|whose) ", str(doing))[0]  # the innermost of what it is in
    else:
        stack = e.get("stack") or ()
        where = f"your code, at {os.path.basename(str(stack[-1]).split()[0])}" if stack else "your code"
    exiting = ": exiting (stall_action=exit)" if e.get("action") == "exit" else ""
    text = f"Stalled {duration(e.get('seconds'))} at step {e.get('step')} ({e.get('state')}) in {where}"
    waits = ", waiting for every rank"
    if e.get("collective") and not exiting and len(text) + len(waits) + 10 <= 96:  # "[rank R] " first
        text += waits
    return f"{text}{exiting}."


def _stall_cleared(e: Event) -> str:
    return (
        f"Moving again after {duration(e.get('seconds'))} stuck at step {e.get('stalled_step')} "
        f"({e.get('stalled_state')})."
    )


# ---------------------------------------------------------------- hooks and the rest
def _ddp_buckets(e: Event) -> str | None:
    action = e.get("action")
    if action == "not_primed":
        return f"DDP's buckets not primed ({first_line(e.get('reason'), 50)}): the resume is not bit-exact."
    if action == "checked" and e.get("exact") is False:
        return "DDP rebuilt its buckets in another layout than the saved one: the resume is not bit-exact."
    return None


def _early_stop(e: Event) -> str:
    return (
        f"Early stop: {e.get('monitor')} not better than {e.get('best')} (step {e.get('best_step')}) "
        f"for {plural(e.get('bad_evaluations'), 'evaluation')}."
    )


#: Event -> its sentence (None: the trail's alone, shown at DEBUG only).
SENTENCES: Final[dict[str, Callable[[Event], str | None] | None]] = {
    "run_start": _run_start,
    "transition": None,
    "steps": None,
    "restore": _restore,
    "data_layout": None,
    "epoch": None,
    "data_resumed": _data_resumed,
    "batch_fingerprint": None,
    "data_exhausted": _data_exhausted,
    "metrics": None,
    "loss_none": _loss_none,
    "non_finite": _non_finite,
    "oom": _oom,
    "checkpoint_saved": _checkpoint_saved,
    "checkpoint_loaded": _checkpoint_loaded,
    "checkpoint_not_loaded": lambda e: "Not loading a checkpoint (load=None): starting fresh.",
    "ddp_buckets": _ddp_buckets,
    "checkpoint_skipped": _checkpoint_skipped,
    "checkpoint_foreign": _checkpoint_foreign,
    "checkpoint_not_newest": _checkpoint_not_newest,
    "checkpoint_pruned": _checkpoint_pruned,
    "checkpoint_tmp_removed": _names("Removed an interrupted save's leftovers"),
    "checkpoint_tmp_completed": _names("Completed an interrupted save's checkpoints"),
    "checkpoint_store_ready": None,
    "checkpoint_room_reserved": None,
    "checkpoint_failed": _checkpoint_failed,
    "signal_received": _signal_received,
    "signal_agreed": _signal_agreed,
    "deadline": _deadline,
    "job_end": _job_end,
    "preempted": _preempted,
    "signal_passed_on": lambda e: f"{e.get('signal')} is not an exit signal here: passed on ({e.get('disposition')}).",
    "signals_not_installed": lambda e: f"Exit signals are not handled: {first_line(e.get('reason'), 70)}.",
    "launcher_stop": lambda e: f"Stopping torchrun's agent (pid {e.get('pid')}) at exit, so it restarts nothing.",
    "restart_stop": lambda e: f"torchrun's agent stopped this rank ({e.get('signal')}) to restart the group.",
    "requeue": _requeue,
    "wandb_run": lambda e: f"wandb run {e.get('wandb_id')}{' (continued)' if e.get('continued') else ''}.",
    "early_stop": _early_stop,
    "cuda_memory_unavailable": lambda e: f"No CUDA memory figures: the trainer runs on {e.get('device')}.",
    "collective_failed": _collective_failed,
    "group_outlives_destroy": lambda e: "torch holds the default process group: the process may abort at exit.",
    "stall": _stall,
    "stall_cleared": _stall_cleared,
    "exception": _exception,
    "exit": _exit,
}
