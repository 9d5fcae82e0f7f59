"""A clean FSDP2 run exits 0: the gloo group it destroys really goes, with its threads.

FSDP2's device meshes outlive the model (DTensor's sharding-propagation cache keeps them) and
hold their process groups, so ``destroy_process_group()`` frees nothing and gloo's threads end in
interpreter shutdown, where they can abort a process that finished cleanly (-6).
``trainfsm.torch_workarounds.release_destroyed_groups`` drops the destroyed groups from the
meshes. Checked on 2 real gloo ranks: the threads before and after it, and kill-and-resume
trials of ``tests/faults/fsdp_teardown.py`` beside a busy process per core.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launch import Ranks
from tests.faults import fsdp_teardown

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo ranks; reads /proc/self/task"),
    pytest.mark.distributed,
]

SCRIPT = """
import gc, json, os, sys, weakref
import torch
import trainfsm  # before the group: see torch_workarounds
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from trainfsm.torch_workarounds import release_destroyed_groups

def gloo_threads():
    gc.collect()
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in tasks)

torch.set_num_threads(1)
port, rank = os.environ["MASTER_PORT"], int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
fully_shard(model[0])
fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
model(torch.randn(4, 4)).pow(2).mean().backward()
optimizer.step()
result = {"while_alive": release_destroyed_groups()}  # the group is not destroyed yet: kept
dist.barrier()  # still usable
group = weakref.ref(dist.group.WORLD)
del model, optimizer
dist.destroy_process_group()
result["after_destroy"] = gloo_threads()
result["dropped"] = release_destroyed_groups()
result["after_release"] = gloo_threads()
result["group_freed"] = group() is None
with open(sys.argv[1] + f".rank{rank}.json", "w") as out:
    json.dump(result, out)
"""


@pytest.fixture(scope="module")
def teardown(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's gloo threads after ``destroy_process_group`` and after ``release_destroyed_groups``."""
    out = tmp_path_factory.mktemp("teardown")
    with Ranks(lambda rank: [sys.executable, "-c", SCRIPT, str(out / "result")], out) as ranks:
        outcome = ranks.wait(120)
    assert not outcome.hung and set(outcome.codes.values()) == {0}, outcome.describe()
    return [json.loads((out / f"result.rank{rank}.json").read_text()) for rank in range(2)]


def test_torch_still_keeps_a_destroyed_group_alive_in_fsdp2s_device_meshes(teardown: list[dict[str, Any]]) -> None:
    """Why the workaround exists; when this stops holding, ``release_destroyed_groups`` can go."""
    if any(result["after_destroy"] == 0 for result in teardown):
        pytest.skip("this torch frees a destroyed group that FSDP2 used: release_destroyed_groups can be removed")
    assert [result["after_destroy"] for result in teardown] == [2, 2]  # gloo's two threads per group


def test_release_destroyed_groups_ends_the_groups_threads(teardown: list[dict[str, Any]]) -> None:
    for result in teardown:
        assert result["after_release"] == 0 and result["group_freed"], result
        assert result["dropped"] >= (1 if result["after_destroy"] else 0)


def test_release_destroyed_groups_keeps_the_groups_still_in_use(teardown: list[dict[str, Any]]) -> None:
    assert [result["while_alive"] for result in teardown] == [0, 0]


# The fast tier's FSDP2 teardown: the module's fixture above (a group destroyed, then released); a rank
# killed in a sharded save: tests/test_sharded_checkpoints.py. These trials run in `make test-all`.
@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.parametrize("trials", [2], ids=["2 trials"])
def test_kill_and_resume_trials_under_cpu_load_exit_0(tmp_path: Path, trials: int) -> None:
    """Trials of ``tests/faults/fsdp_teardown.py`` (a rank killed in a sharded save, then the
    resumed launch must exit 0 on both ranks with no gloo thread left); the bitwise-exact resume
    is the script's and ``test_sharded_checkpoints``'s to check."""
    rng = random.Random(0)
    with fsdp_teardown.cpu_load():
        for index in range(trials):
            ok, detail = fsdp_teardown.trial(tmp_path / f"trial{index}", None, rng)
            assert ok, detail
