"""One rank of a sharded-checkpoint scenario (``tests/test_sharded_checkpoints.py`` starts them).

    python tests/distributed/sharded_worker.py SCENARIO --out DIR [--action die_rank0]

Models, data and the trainer come from ``worker.py``. Each scenario writes what the test checks
to ``DIR/SCENARIO.rank{R}.pt`` and its runs' workspaces (checkpoints, audit trails) under ``DIR``.

- ``world1_before`` (1 process): a full checkpoint of a plain model, for a 2-rank DDP resume.
- ``fsdp`` (2 ranks): FSDP2 runs with sharded checkpoints: uninterrupted, saved then resumed,
  a corrupted shard, ``sharded=False``, a stateless optimizer; DDP saving a full checkpoint; DDP
  resuming the 1-process checkpoint; ``async_save``: saved then resumed, and a background save
  that fails on rank 1.
- ``world1_after`` (1 process): resumes the 2-rank DDP full checkpoint and the 2-rank sharded one.
- ``kill`` (2 ranks): sharded saves at steps 2 and 4; ``--action die_rankR`` kills rank R with
  ``os._exit`` in the middle of the step-4 save, after the shards are written, before the manifest
  (``die_rankR_async``: the same with ``async_save``, so on the writer thread).

After the group is destroyed, each rank drops it from the device meshes that FSDP2 left behind
(``trainfsm.torch_workarounds.release_destroyed_groups``; ``--keep-groups`` skips that call, to
show the group outliving its destruction) and prints ``gloo threads after cleanup: N`` on stderr.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import trainfsm.distributed
from tests.distributed.worker import Scenario, _params, ddp, fsdp_mlp, make_trainer, mlp, parser, serve
from trainfsm import BaseHook, CheckpointingHook


class Snapshot(BaseHook):
    """The parameters as RESTORE left them (gathered when sharded)."""

    def __init__(self) -> None:
        self.restored: list[torch.Tensor] | None = None

    def on_exit_restore(self, trainer: Any) -> None:
        self.restored = _params(trainer)


def train(workspace: Path, model: Any, steps: int, optimizer: str = "adam", **hook: Any) -> dict[str, Any]:
    """One run; its parameters after RESTORE and at the end, or its error."""
    snapshot = Snapshot()
    hook.setdefault("interval", 3)
    trainer = make_trainer(
        model=model, optimizer=optimizer, lr=0.01, max_steps=steps, workspace=workspace,
        hooks=[CheckpointingHook(**hook), snapshot],
    )  # fmt: skip
    try:
        trainer.train()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "step": trainer.step}
    return {"error": None, "restored": snapshot.restored, "params": _params(trainer), "step": trainer.step}


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def scenario_world1_before(out: Path, rank: int) -> dict[str, Any]:
    return {"ddp1to2": train(out / "ddp1to2", mlp, 3)}


def scenario_fsdp(out: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    result["uninterrupted"] = train(out / "uninterrupted", fsdp_mlp, 6)
    result["first"] = train(out / "resume", fsdp_mlp, 3)
    result["resumed"] = train(out / "resume", lambda: fsdp_mlp(1), 6)  # other initial weights: all loaded

    # Two sharded checkpoints (2, 4); then a flipped byte in rank 1's shard of the newest: rank 1
    # finds it, and both ranks must load step 2.
    result["corrupt_first"] = train(out / "corrupt", fsdp_mlp, 4, interval=2, keep_previous=1)
    barrier()
    if rank == 0:
        shard = out / "corrupt" / "checkpoints" / "4" / "sharded" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    barrier()
    result["corrupt_resumed"] = train(out / "corrupt", fsdp_mlp, 4, interval=2, keep_previous=1)

    result["refused"] = train(out / "refused", fsdp_mlp, 3, sharded=False)
    result["sgd_first"] = train(out / "sgd", fsdp_mlp, 3, optimizer="sgd")
    result["sgd_resumed"] = train(out / "sgd", lambda: fsdp_mlp(1), 3, optimizer="sgd")

    result["ddp2to1"] = train(out / "ddp2to1", lambda: ddp(mlp()), 3)  # full: DDP's state is not split
    # The model's state reshards; the batches (a list, no DistributedSampler) cannot: accepted as such.
    result["ddp1to2"] = train(out / "ddp1to2", lambda: ddp(mlp(1)), 5, data_reshard="approximate")

    # async_save: each rank writes its shards in the background; the same run as "first"/"resumed".
    before = gloo_threads()
    result["async_first"] = train(out / "async", fsdp_mlp, 3, async_save=True)
    result["async_resumed"] = train(out / "async", lambda: fsdp_mlp(1), 6, async_save=True)
    result["async_gloo_threads"] = (before, gloo_threads())  # the hook's own group is gone after EXIT
    result["async_failed"] = fail_rank1_step4_in_the_background(out / "async_failed")
    return result


def gloo_threads() -> int:
    """How many gloo worker threads this process runs (two per live gloo process group)."""
    import gc

    gc.collect()  # a trainer that is gone may still sit in a reference cycle
    names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")


def fail_rank1_step4_in_the_background(workspace: Path) -> dict[str, Any]:
    """Saves at 2, 4, 6 in the background; rank 1 cannot read back its step-4 shard."""
    import torch.distributed as dist

    import trainfsm.checkpoint.save as checkpointing

    describe = checkpointing.describe_file

    def unreadable_at_step_4(path: Path, checksum: str) -> dict[str, Any]:
        if dist.get_rank() == 1 and ".tmp-4-" in str(path):
            raise OSError(5, "Input/output error", str(path))
        return describe(path, checksum)

    checkpointing.describe_file = unreadable_at_step_4  # type: ignore[assignment]
    try:
        return train(workspace, fsdp_mlp, 6, interval=2, async_save=True)
    finally:
        checkpointing.describe_file = describe  # type: ignore[assignment]


def scenario_world1_after(out: Path, rank: int) -> dict[str, Any]:
    shutil.copytree(out / "resume" / "checkpoints", out / "fsdp2to1" / "checkpoints", symlinks=True)
    return {
        # The model's state reshards; the batches (a list, no DistributedSampler) cannot: accepted as such.
        "ddp2to1": train(out / "ddp2to1", lambda: mlp(1), 5, data_reshard="approximate"),
        "fsdp2to1": train(out / "fsdp2to1", lambda: fsdp_mlp(1), 8, data_reshard="approximate"),
    }


def scenario_kill(out: Path, rank: int, action: str) -> dict[str, Any]:
    """``action``: ``die_rank{R}`` or ``die_rank{R}_async`` (the saves run in the background)."""
    if action.removesuffix("_async") == f"die_rank{rank}":
        import trainfsm.checkpoint.save as checkpointing

        describe = checkpointing.describe_file

        def die_in_step_4_save(path: Path, checksum: str) -> dict[str, Any]:
            if ".tmp-4-" in str(path):
                os._exit(9)  # like a SIGKILL: no cleanup, no goodbye to the process group
            return describe(path, checksum)

        checkpointing.describe_file = die_in_step_4_save  # type: ignore[assignment]
    asynchronous = action.endswith("_async")
    return {"run": train(out / "kill", fsdp_mlp, 4, interval=2, keep_previous=1, async_save=asynchronous)}


SCENARIOS: dict[str, Scenario] = {
    "world1_before": lambda args, rank: scenario_world1_before(args.out, rank),
    "fsdp": lambda args, rank: scenario_fsdp(args.out, rank),
    "world1_after": lambda args, rank: scenario_world1_after(args.out, rank),
    "kill": lambda args, rank: scenario_kill(args.out, rank, args.action),
}


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--keep-groups", action="store_true", help="leave destroyed groups in the device meshes")
    args = arguments.parse_args()
    if args.keep_groups:  # cleanup_distributed() as it was before the workaround
        trainfsm.distributed.release_destroyed_groups = lambda: 0  # type: ignore[assignment]
    try:
        serve(SCENARIOS, args, "sharded_worker.py")  # ends with cleanup_distributed()
    finally:
        print(f"gloo threads after cleanup: {gloo_threads()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
