"""Schedules, warm-up, the LR range test, seeding and devices, distributed helpers."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from trainfsm.devices import get_device, get_device_type, seed_all
from trainfsm.distributed import read_env, wrap_model
from trainfsm.lr_finder import lr_find
from trainfsm.schedules import SCHEDULES, create_scheduler, resolve_warmup_steps


def lrs(kind: str, total: int = 10, warmup: int = 0) -> list[float]:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = create_scheduler(optimizer, kind, total, warmup)
    out = []
    for _ in range(total):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_constant() -> None:
    assert lrs("constant") == [1.0] * 10


def test_constant_with_warmup_rises_then_stays() -> None:
    assert lrs("constant_with_warmup", warmup=3) == pytest.approx([0.25, 0.5, 0.75] + [1.0] * 7)


def test_linear_decays_to_zero_after_warmup() -> None:
    assert lrs("linear", total=6, warmup=2) == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])


def test_cosine_follows_half_a_cosine() -> None:
    values = lrs("cosine", total=5, warmup=0)
    assert values == pytest.approx([0.5 * (1 + math.cos(math.pi * i / 5)) for i in range(5)])


def test_unknown_schedule_lists_the_valid_ones() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(
        ValueError, match="scheduler_type must be one of constant, constant_with_warmup, linear, cosine"
    ):
        create_scheduler(optimizer, "step", 10)
    assert SCHEDULES == ("constant", "constant_with_warmup", "linear", "cosine")


def test_resolve_warmup_steps() -> None:
    assert resolve_warmup_steps(None, None, 100) == 0
    assert resolve_warmup_steps(7, None, 100) == 7
    assert resolve_warmup_steps(None, 0.05, 100) == 5
    with pytest.raises(ValueError, match="not both"):
        resolve_warmup_steps(5, 0.1, 100)
    with pytest.raises(ValueError, match="warmup_ratio must be a number in \\[0, 1\\]"):
        resolve_warmup_steps(None, 1.5, 100)
    with pytest.raises(ValueError, match="must not exceed total_steps"):
        resolve_warmup_steps(200, None, 100)


def test_a_resumed_schedule_continues_exactly() -> None:
    def make() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        return optimizer, create_scheduler(optimizer, "cosine", 20, 4)

    optimizer, scheduler = make()
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    state = (optimizer.state_dict(), scheduler.state_dict())
    optimizer2, scheduler2 = make()
    scheduler2.load_state_dict(state[1])
    optimizer2.load_state_dict(state[0])
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        optimizer2.step()
        scheduler2.step()
        assert optimizer.param_groups[0]["lr"] == optimizer2.param_groups[0]["lr"]


def _problem() -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    return (
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)],
    )


def test_lr_find_restores_model_and_optimizer_and_suggests_a_rate(tmp_path: Path) -> None:
    model, optimizer, batches = _problem()
    optimizer.zero_grad()
    nn.functional.mse_loss(model(batches[0][0]), batches[0][1]).backward()
    optimizer.step()  # some optimizer state to restore
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_opt = {
        k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
        for k, s in optimizer.state_dict()["state"].items()
    }
    result = lr_find(
        model,
        optimizer,
        batches,
        lambda b: nn.functional.mse_loss(model(b[0]), b[1]),
        start_lr=1e-5,
        end_lr=10.0,
        num_steps=60,
        plot_path=tmp_path / "lr.png",
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after_opt = optimizer.state_dict()["state"]
    assert all(torch.equal(t, after_opt[k][n]) for k, s in before_opt.items() for n, t in s.items())
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert result.lrs[0] == pytest.approx(1e-5) and len(result.lrs) == len(result.losses) <= 60
    assert result.suggestion is not None and 1e-5 < result.suggestion < 10
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lr_find_stops_when_the_loss_diverges() -> None:
    model, optimizer, batches = _problem()
    result = lr_find(
        model,
        optimizer,
        batches,
        lambda b: nn.functional.mse_loss(model(b[0]), b[1]),
        start_lr=1e-3,
        end_lr=1e4,
        num_steps=100,
    )
    assert result.diverged and len(result.lrs) < 100


def test_lr_find_bad_arguments() -> None:
    model, optimizer, batches = _problem()
    with pytest.raises(ValueError, match="0 < start_lr < end_lr"):
        lr_find(model, optimizer, batches, lambda b: model(b[0]).sum(), start_lr=1.0, end_lr=0.1)
    with pytest.raises(ValueError, match="num_steps must be an int >= 2"):
        lr_find(model, optimizer, batches, lambda b: model(b[0]).sum(), num_steps=1)


def test_seed_all_makes_python_numpy_and_torch_repeat() -> None:
    import numpy

    seed_all(123)
    first = (random.random(), numpy.random.rand(), torch.rand(1).item())
    seed_all(123)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == first
    with pytest.raises(ValueError, match="seed must be an int"):
        seed_all(-1)


def test_device_helpers_on_this_machine() -> None:
    expected = "cuda" if torch.cuda.is_available() else get_device_type()
    assert get_device_type() == expected
    assert get_device().type == expected


def test_read_env_from_torchrun_and_slurm() -> None:
    torchrun = read_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.master_addr, torchrun.master_port) == (
        1,
        2,
        1,
        "h",
        1234,
    )
    slurm = read_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "MASTER_ADDR": "n1"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.master_addr) == (3, 4, 1, "n1")
    assert read_env({}) is None


def test_wrap_model_strategies() -> None:
    model = nn.Linear(2, 2)
    assert wrap_model(model, "none") is model
    with pytest.raises(ValueError, match="strategy must be one of none, ddp, fsdp"):
        wrap_model(model, "zero3")
    with pytest.raises(RuntimeError, match="needs a process group"):
        wrap_model(model, "ddp")
