"""A process group that a training script destroys is really gone: gloo's threads end with it.

Each case runs in a fresh interpreter, since what matters is which modules were imported before
the group existed. The script builds an optimizer after ``init_process_group`` (that is what
imports ``torch.distributed.nn.functional`` in torch 2.13), destroys the group, and prints the
names of its own threads. Where trainfsm comes too late to help, a trainer's BUILD says so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import trail_events

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")

SCRIPT = """
import gc, json, os, sys
if sys.argv[1] in ("first-use", "init_distributed"):
    import trainfsm  # before torch: imports none of it
if sys.argv[1] == "first-use":
    trainfsm.CheckpointingHook
import torch
if sys.argv[1] == "before":
    import trainfsm
import torch.distributed as dist
if sys.argv[1] == "init_distributed":
    from trainfsm.distributed import init_distributed
    init_distributed("gloo")
else:
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
if sys.argv[1] == "after":
    import trainfsm
torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
dist.destroy_process_group()
gc.collect()
print(json.dumps(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))))
"""


def threads_after_destroy(tmp_path: Path, when: str, env: dict[str, str] | None = None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, when, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def gloo_threads(names: list[str]) -> list[str]:
    return [name for name in names if "gloo" in name]


@pytest.mark.slow
def test_a_group_created_after_import_trainfsm_ends_its_threads_at_destroy(tmp_path: Path) -> None:
    assert gloo_threads(threads_after_destroy(tmp_path, "before")) == []


@pytest.mark.slow
def test_a_group_created_after_the_first_use_of_a_trainfsm_name_ends_its_threads(tmp_path: Path) -> None:
    """``import trainfsm`` before torch imports no torch; the first name used from it does the import."""
    assert gloo_threads(threads_after_destroy(tmp_path, "first-use")) == []


def test_a_group_created_by_init_distributed_ends_its_threads_at_destroy(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a free port for the one-rank TCP store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    assert gloo_threads(threads_after_destroy(tmp_path, "init_distributed", env)) == []


@pytest.mark.slow
def test_torch_still_keeps_a_group_alive_that_existed_before_the_first_optimizer(tmp_path: Path) -> None:
    """Why the workaround exists; when this stops holding, ``trainfsm.torch_workarounds`` can go."""
    alive = gloo_threads(threads_after_destroy(tmp_path, "after"))
    if not alive:
        pytest.skip("this torch no longer keeps a destroyed group alive: the workaround can be removed")
    assert "pt_gloo_runloop" in alive


TRAIN = """
import json, sys, warnings
import torch
if sys.argv[1] == "before":
    import trainfsm
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
import trainfsm

class Tiny(trainfsm.BaseTrainer):
    def build_data_loader(self): return [torch.ones(2, 2)]
    def build_model(self): return torch.nn.Linear(2, 1)
    def build_optimizer(self): return torch.optim.SGD(self.model.parameters(), lr=0.1)
    def forward(self, batch): return self.model(batch).sum(), {}

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    Tiny(max_steps=1, workspace=sys.argv[3]).train()
dist.destroy_process_group()
print(json.dumps([w.category.__name__ for w in caught]))
"""


def train_in_a_group(tmp_path: Path, when: str) -> tuple[list[str], list[dict[str, object]]]:
    """The warnings a one-step run in a 1-rank gloo group gave, and its trail's warning events."""
    done = subprocess.run(
        [sys.executable, "-c", TRAIN, when, str(tmp_path / "store"), str(tmp_path / "ws")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    events = trail_events(tmp_path / "ws")
    return json.loads(done.stdout.splitlines()[-1]), [e for e in events if e["event"] == "group_outlives_destroy"]


def test_build_warns_when_trainfsm_was_imported_after_the_group_was_created(tmp_path: Path) -> None:
    caught, events = train_in_a_group(tmp_path, "after")
    assert caught.count("GroupOutlivesDestroyWarning") == 1
    [event] = events
    assert "Import trainfsm before init_process_group" in event["cause"]


@pytest.mark.slow
def test_build_does_not_warn_when_trainfsm_came_first(tmp_path: Path) -> None:
    caught, events = train_in_a_group(tmp_path, "before")
    assert "GroupOutlivesDestroyWarning" not in caught and events == []
