"""A process group that a training script destroys is really gone: gloo's threads end with it.

Each case runs in a fresh interpreter, since what matters is which modules were imported before
the group existed. The script builds an optimizer after ``init_process_group`` (that is what
imports ``torch.distributed.nn.functional`` in torch 2.13), destroys the group, and prints the
names of its own threads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")

SCRIPT = """
import gc, json, os, sys
import torch
if sys.argv[1] == "before":
    import trainfsm
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
if sys.argv[1] == "after":
    import trainfsm
torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
dist.destroy_process_group()
gc.collect()
print(json.dumps(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))))
"""


def threads_after_destroy(tmp_path: Path, when: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, when, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def gloo_threads(names: list[str]) -> list[str]:
    return [name for name in names if "gloo" in name]


def test_a_group_created_after_import_trainfsm_ends_its_threads_at_destroy(tmp_path: Path) -> None:
    assert gloo_threads(threads_after_destroy(tmp_path, "before")) == []


def test_torch_still_keeps_a_group_alive_that_existed_before_the_first_optimizer(tmp_path: Path) -> None:
    """Why the workaround exists; when this stops holding, ``trainfsm.torch_workarounds`` can go."""
    alive = gloo_threads(threads_after_destroy(tmp_path, "after"))
    if not alive:
        pytest.skip("this torch no longer keeps a destroyed group alive: the workaround can be removed")
    assert "pt_gloo_runloop" in alive
