"""One NCCL rank on one GPU (the GPU tier, ``make test-gpu``): ``init_distributed("nccl")`` from
torchrun's variables, the step-end signal agreement under an NCCL default group (a CPU flag in the
gloo host group: no device sync), and FSDP2 (``fully_shard``) with sharded checkpoints, written in
the step and in the background, resumed exactly.

The process group is this test process's own, made once for the module (NCCL's start takes
seconds) and destroyed after it; the gloo cases with several ranks are tests/test_fsdp.py's,
tests/test_sharded_checkpoints.py's and tests/test_distributed_signals.py's.
"""

from __future__ import annotations

import json
import signal
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.launch import free_port
from tests.helpers import trail_events
from trainfsm import BaseTrainer, CheckpointingHook, collectives
from trainfsm.distributed import DistEnv, cleanup_distributed, init_distributed

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

SYNC = "called a synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says


@pytest.fixture(scope="module")
def nccl() -> Iterator[DistEnv]:
    """The default group: NCCL, one rank, from the variables torchrun would set."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
            env.setenv(name, value)
        env.setenv("MASTER_PORT", str(free_port()))
        env.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)  # not under torchrun: rank 0 hosts the store
        layout = init_distributed("nccl", timeout=timedelta(seconds=60))
        assert layout is not None
        try:
            yield layout
        finally:
            cleanup_distributed()


def test_init_distributed_nccl_with_one_rank_makes_a_working_nccl_group(nccl: DistEnv) -> None:
    assert (nccl.rank, nccl.world_size, nccl.local_rank) == (0, 1, 0)
    assert dist.is_initialized() and dist.get_backend() == "nccl"
    assert "cpu:" not in dist.get_backend_config()  # no CPU backend: host flags need a group of their own
    assert torch.cuda.current_device() == 0
    value = torch.full((4,), 3.0, device="cuda")
    dist.all_reduce(value)
    assert value.tolist() == [3.0] * 4


def test_the_signal_agreement_over_an_nccl_default_group_runs_on_gloo_with_a_cpu_flag_and_no_device_sync(
    nccl: DistEnv,
) -> None:
    agreement = collectives.SignalAgreement()  # every rank makes it in BUILD (collective when it makes the group)
    host = collectives.host_group()
    assert host is not None and dist.get_backend(host) == "gloo"
    assert agreement._flag.device.type == "cpu"
    busy = torch.ones(4096, 4096, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                busy = busy @ busy / 4096  # device work queued while the flags go round
                agreement.start(int(signal.SIGUSR1))
                assert agreement.result() == signal.SIGUSR1
                agreement.start(0)
                assert agreement.result() == 0
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if SYNC in str(w.message)] == []
    torch.cuda.synchronize()


class FsdpTrainer(BaseTrainer):
    """A small MLP sharded with ``fully_shard`` on the NCCL mesh, Adam, dropout on the GPU."""

    def __init__(self, hook: CheckpointingHook, **kwargs: Any) -> None:
        super().__init__(device="cuda", **kwargs)
        self.hook = hook

    def build_data_loader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

    def build_model(self) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1)).to(self.device)
        for layer in (model[0], model[3]):
            fully_shard(layer)
        return fully_shard(model)  # type: ignore[no-any-return]

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=1e-2)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        return [self.hook]

    def forward(self, input: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = (t.to(self.device) for t in input)
        return nn.functional.mse_loss(self.model(x), y), {}  # type: ignore[misc]


def full_parameters(trainer: BaseTrainer) -> list[torch.Tensor]:
    """The parameters as whole tensors on the host (a DTensor's ``full_tensor``)."""
    out = []
    for param in trainer.model.parameters():  # type: ignore[union-attr]
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        out.append(whole.detach().cpu().clone())
    return out


def fsdp_run(workspace: Path, steps: int, async_save: bool) -> FsdpTrainer:
    trainer = FsdpTrainer(CheckpointingHook(interval=4, async_save=async_save), max_steps=steps, workspace=workspace)
    trainer.train()
    return trainer


@pytest.mark.parametrize("async_save", [False, True], ids=["in_the_step", "asynchronous"])
def test_a_sharded_fsdp2_checkpoint_on_one_gpu_is_written_with_dcp_and_resumes_exactly(
    nccl: DistEnv, tmp_path: Path, async_save: bool
) -> None:
    straight = full_parameters(fsdp_run(tmp_path / "straight", 8, async_save))
    fsdp_run(tmp_path / "resumed", 4, async_save)
    resumed = fsdp_run(tmp_path / "resumed", 8, async_save)  # dropout's CUDA stream as step 4 left it
    assert resumed.step == 8
    for a, b in zip(straight, full_parameters(resumed), strict=True):
        assert torch.equal(a, b)

    saved = [e for e in trail_events(tmp_path / "resumed") if e["event"] == "checkpoint_saved"]
    assert [(e["saved_step"], e["sharded"], e["asynchronous"], e["world_size"]) for e in saved] == [
        (4, True, async_save, 1),
        (8, True, async_save, 1),
    ]
    [loaded] = [e for e in trail_events(tmp_path / "resumed") if e["event"] == "checkpoint_loaded"]
    assert (loaded["from_step"], loaded["sharded"], loaded["saved_world_size"]) == (4, True, 1)
    manifest = json.loads((tmp_path / "resumed" / "checkpoints" / "8" / "manifest.json").read_text())
    assert manifest["sharded"] is True and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == ["sharded/.metadata", "sharded/__0_0.distcp", "training_state.pt"]
