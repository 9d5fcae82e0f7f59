"""A completed DDP run exits 0 when its script destroys the group but still holds the trainer.

``DistributedDataParallel`` holds its process group (``process_group``, its reducer and the
reducer's logger), so ``destroy_process_group()`` frees nothing while the script still refers to
the trainer or the model: gloo's threads run into interpreter shutdown. When one of them is still
busy with the last collective there (a loaded machine delays its thread now and then), it releases
the work item's tensors once the interpreter is finalizing, their Python objects need the GIL, and
C++ aborts the process: -6, "terminate called without an active exception" (issue 48, item 5).
``trainfsm.torch_workarounds.release_destroyed_groups`` drops a destroyed group from every live DDP
model (``cleanup_distributed`` calls it), and the trainer has it run once more at the interpreter's
exit (``release_groups_at_exit``), so gloo's threads end while the interpreter is alive.

Two gloo ranks train a tiny DDP model with a trainer in ``main()``; then rank 0 starts one more
all-reduce and ends, the trainer still held when it destroys the group (garbage once ``main()``
returns, freed when the interpreter collects it at shutdown). Rank 1 joins that all-reduce a
second later, so rank 0's gloo thread is busy with it whenever the group goes: the late release,
every time.
Trials of four-rank resumed runs under CPU load: ``tests/faults/exit_abort.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launch import Ranks

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo ranks; reads /proc/self/task"),
    pytest.mark.distributed,
]

SCRIPT = """
import atexit, json, os, sys, time
import torch
import trainfsm  # before the group: see torch_workarounds
import torch.distributed as dist
from torch import nn
from trainfsm.distributed import cleanup_distributed
from trainfsm.torch_workarounds import release_destroyed_groups

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(name in ("pt_gloo_runloop", "gloo_tcp_loop") for name in names)

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
result = {}

def report():  # registered before train(): runs after trainfsm's own exit handler (atexit is LIFO)
    result["at_exit"] = gloo_threads()
    with open(f"{out}.rank{rank}.json", "w") as file:
        json.dump(result, file)

atexit.register(report)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank, world_size=2)

class Tiny(trainfsm.BaseTrainer):
    def build_data_loader(self):
        return [torch.ones(4, 8) * (rank + 1)] * 3
    def build_model(self):
        torch.manual_seed(0)
        return nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)
    def forward(self, batch):
        return self.model(batch).pow(2).mean(), {}

def main():
    trainer = Tiny(max_steps=2, device="cpu")
    trainer.train()
    result["while_alive"] = release_destroyed_groups()  # a group in use is left alone
    result["reducer_kept"] = hasattr(trainer.model, "reducer")
    if rank == 1:
        time.sleep(1.0)  # rank 0 is at its end by now; its gloo thread waits in this all-reduce
    dist.all_reduce(torch.ones(1 << 16), async_op=True)  # not waited for: a last collective still running
    if mode == "cleanup":
        cleanup_distributed()
    else:
        dist.destroy_process_group()  # the trainer, its DDP model, still held: the group is not freed
    result["after_destroy"] = gloo_threads()

main()  # the trainer, garbage from here on (it is in reference cycles), goes when the interpreter collects
"""


def run(directory: Path, mode: str) -> list[dict[str, Any]]:
    """Each rank's gloo threads: after the script's destroy, at its exit; its exit status must be 0."""
    out = directory / mode
    with Ranks(lambda rank: [sys.executable, "-c", SCRIPT, mode, str(out)], directory / f"logs-{mode}") as ranks:
        outcome = ranks.wait(120)
    assert not outcome.hung and outcome.codes == {0: 0, 1: 0}, outcome.describe()
    return [json.loads(out.with_name(f"{mode}.rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def destroyed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The script ends with ``dist.destroy_process_group()``, its trainer still held."""
    return run(tmp_path_factory.mktemp("destroy"), "destroy")


def test_torch_still_keeps_a_destroyed_group_alive_in_a_ddp_model(destroyed: list[dict[str, Any]]) -> None:
    """Why the workaround exists; when this stops holding, ``release_groups_at_exit`` can go."""
    if any(result["after_destroy"] == 0 for result in destroyed):
        pytest.skip("this torch frees a destroyed group that a DDP model holds: release_groups_at_exit can go")
    assert [result["after_destroy"] for result in destroyed] == [3, 3]  # two runloops and gloo's I/O loop


def test_a_script_that_destroys_the_group_and_keeps_its_trainer_exits_0(destroyed: list[dict[str, Any]]) -> None:
    """Exit status 0 on both ranks (``run``), and gloo's threads gone before the interpreter's shutdown."""
    assert [result["at_exit"] for result in destroyed] == [0, 0], destroyed


def test_release_destroyed_groups_leaves_a_ddp_model_whose_group_is_in_use(destroyed: list[dict[str, Any]]) -> None:
    for result in destroyed:
        assert result["while_alive"] == 0 and result["reducer_kept"], result


@pytest.mark.slow  # the fast tier's is the plain destroy_process_group() above
def test_cleanup_distributed_frees_the_group_that_a_kept_ddp_model_holds(tmp_path: Path) -> None:
    assert [result["after_destroy"] for result in run(tmp_path, "cleanup")] == [0, 0]
