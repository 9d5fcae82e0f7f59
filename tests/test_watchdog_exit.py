"""The stall exit's edges (issue 46): ``stall_action="exit"`` ends the process even when the stall is
in the I/O it reports on, its write-out of the trainer thread's records neither duplicates nor
loses a line, and a stall that recurs at the same step and state stops the requeue loop."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainfsm.machine import ROUTINE_END, ROUTINE_START
from trainfsm.trail.writer import EventLog


# ---------------------------------------------------------------- the exit's write-out
def event_log(path: Path, owner: Any) -> EventLog:
    return EventLog(
        path=path,
        console=logging.getLogger("trainfsm.test"),
        rank=0,
        run_id="r",
        attempt=0,
        progress=lambda: (owner.step, "STEP"),
        owner=owner,
    )


def steps_in(path: Path) -> list[int]:
    """The steps whose end (``stepped``) the file holds, once per line that holds it."""
    found: list[int] = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "steps":
            found.extend(range(event["first"], event["step"] + 1))
        elif event["event"] == "transition" and event["trigger"] == "stepped":
            found.append(event["step"])
    return found


def write_out_while_recording(path: Path, pause: float) -> tuple[int, list[int]]:
    """A trainer's thread records steps (a save's transition every 7th, an event every 13th) while
    this thread takes the trail over after ``pause``: (steps ended before, steps in the file)."""
    owner = SimpleNamespace(step=0)
    log = event_log(path, owner)
    start, end = log.transition_recorder(*ROUTINE_START), log.transition_recorder(*ROUTINE_END)
    save = log.transition_recorder("save", "STEP", "CHECKPOINT")
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            owner.step += 1
            start()
            end()
            if owner.step % 7 == 0:
                save()  # not routine: queued verbatim, the open run spilled first
            if owner.step % 13 == 0:
                log.log.info("note")  # an event: what was queued is drained first

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    time.sleep(pause)
    before = owner.step - 1  # steps ended before the handover began
    log.write_out_before_exit()
    stop.set()  # the thread waits at its next write: the trail is the exiting thread's now
    written = steps_in(path)
    log.hand_back()  # only a test gets the trail back: the watchdog's process ends instead
    thread.join(5)
    log.close()
    return before, written


def test_the_exit_write_out_neither_duplicates_nor_loses_a_line_while_the_trainer_thread_still_records(
    tmp_path: Path,
) -> None:
    """A slow trainer thread (not stuck) records steps while the watchdog writes out: every step
    recorded before the handover is in the file exactly once, and no step twice."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the race, every trial
    try:
        for trial in range(40):
            before, written = write_out_while_recording(tmp_path / f"{trial}.jsonl", 0.002 * (trial % 5))
            duplicated = sorted({s for s in written if written.count(s) > 1})
            lost = sorted(set(range(1, before + 1)) - set(written))
            assert (duplicated, lost) == ([], []), f"trial {trial}: {len(written)} steps written"
    finally:
        sys.setswitchinterval(interval)
