"""The first save of a process does no one-time work: RESTORE did it (issue 35, item 3).

What a first save would otherwise do once: import what torch's serializer needs (``rehearse``),
start the store's I/O thread and the asynchronous writer's thread, make the staging buffers, and
measure the disk (``trainfsm.checkpoint.writemode``). A fresh interpreter runs a tiny trainer
synchronously and then one with ``async_save=True``; hooks on each side of ``CheckpointingHook``
record what each save imported, which threads it started and which one-off calls it made. A
third trainer, synchronous again, finds the disk measured already: its I/O thread is started in
RESTORE all the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from trainfsm.checkpoint import writemode

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, threading
from pathlib import Path

from tests.helpers import TinyTrainer
from trainfsm import BaseHook, CheckpointingHook
from trainfsm.checkpoint import io, store, writemode

calls = {"staging": 0, "probe": 0, "rehearse": 0}

def counted(name, function):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)
    return wrapper

io.Staging.__init__ = counted("staging", io.Staging.__init__)
writemode._probe = counted("probe", writemode._probe)
store.rehearse = counted("rehearse", store.rehearse)

def look():
    return set(sys.modules), {t.ident for t in threading.enumerate()}, dict(calls)

class Before(BaseHook):
    def on_enter_checkpoint(self, trainer):
        self.seen = look()

class After(BaseHook):
    def __init__(self, before):
        self.before, self.saves, self.restored = before, [], None
    def on_before_train(self, trainer):
        self.restored = dict(calls)
    def on_enter_checkpoint(self, trainer):
        modules, threads, counts = self.before.seen
        now_modules, now_threads, now_counts = look()
        self.saves.append({
            "modules": sorted(now_modules - modules),
            "threads": sorted(t.name for t in threading.enumerate() if t.ident not in threads),
            "calls": {k: now_counts[k] - counts[k] for k in counts},
        })

out = {}
for label in ("sync", "async", "sync again"):
    before = Before()
    after = After(before)
    hook = CheckpointingHook(interval=2, async_save=label == "async")
    TinyTrainer(max_steps=4, workspace=Path(sys.argv[1]) / label, hooks=[before, hook, after]).train()
    out[label] = {"restored": after.restored, "saves": after.saves}
print(json.dumps(out))
"""


def run_child(tmp_path: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_first_save_does_nothing_restore_should_have_done(tmp_path: Path) -> None:
    result = run_child(tmp_path)
    nothing = {"modules": [], "threads": [], "calls": {"staging": 0, "probe": 0, "rehearse": 0}}
    for label in ("sync", "async", "sync again"):
        saves = result[label]["saves"]
        assert len(saves) == 2
        assert saves == [nothing, nothing], f"{label}: {saves}"
    # It was done in RESTORE instead: the buffers and the serializer's rehearsal once per store,
    # the disk's measurement once per process and file system (the second store reuses it).
    probes = 2 + 2 * writemode.PROBE_FILES  # each way's file, then the timed writes over it
    assert result["sync"]["restored"] == {"staging": 1, "probe": probes, "rehearse": 1}
    assert result["async"]["restored"] == {"staging": 2, "probe": probes, "rehearse": 2}
    assert result["sync again"]["restored"] == {"staging": 3, "probe": probes, "rehearse": 3}


def test_background_saves_start_their_thread_and_sharded_group_when_asked(monkeypatch: Any) -> None:
    # The hook calls start() in RESTORE, where every rank is at once: the group's creation is a collective.
    import threading

    from trainfsm.checkpoint import background

    groups: list[object] = []
    monkeypatch.setattr(background, "_background_group", lambda: groups.append(object()) or groups[-1])
    saves: background.BackgroundSaves[None] = background.BackgroundSaves()
    saves.start(world_size=2, sharded=True)
    try:
        assert len(groups) == 1 and saves.process_group(2) is groups[0]
        assert any(t.name.startswith("trainfsm-async-save") for t in threading.enumerate())
        saves.start(world_size=2, sharded=True)  # once
        assert len(groups) == 1
    finally:
        saves._group = None  # not a real group: nothing to destroy
        saves.close()
    one = background.BackgroundSaves[None]()
    one.start(world_size=1, sharded=True)  # one rank: no collective to keep apart
    one.close()
    assert len(groups) == 1


def test_an_asynchronous_save_copies_into_the_cpu_tensors_restore_made_and_the_last_save_used(tmp_path: Path) -> None:
    # Fresh CPU memory at every save would be page-faulted anew by the writer thread's copies,
    # and the next optimizer step waits for those copies.
    from tests.helpers import TinyTrainer, read_events
    from trainfsm import BaseHook, CheckpointingHook

    staged: list[list[int]] = []
    prestaged: list[int] = []

    class Look(BaseHook):
        def on_before_train(self, trainer: Any) -> None:
            prestaged.extend(t.data_ptr() for t in hook._background.spare)

        def on_enter_checkpoint(self, trainer: Any) -> None:
            staged.append([t.data_ptr() for t in hook._background.spare])

    hook = CheckpointingHook(interval=1, async_save=True)
    TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[hook, Look()]).train()
    # Linear(3, 1)'s weight and bias (SGD keeps no state) and the random streams' tensors, staged
    # by the first save and copied into by each later one
    assert len(staged) == 4 and len(staged[0]) >= 2
    assert staged[1:] == staged[:1] * 3
    assert len(prestaged) == 2 and set(prestaged) <= set(staged[0])  # the parameters': made in RESTORE
    saved = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert [e["saved_step"] for e in saved] == [1, 2, 3, 4]
