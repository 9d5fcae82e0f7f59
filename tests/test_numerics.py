"""What the trainer does to the weights: accumulation, retries, loss=None, clipping, the LR
scheduler, bf16 autocast and the fp16 grad scaler, checked against SGD computed by hand.

The mixed-precision tests run on CPU and, in the GPU tier (``make test-gpu``), on CUDA: the same
tiny model and batches, the same reference, autocast and ``GradScaler`` of the other device."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import INIT_BIAS, INIT_WEIGHT, RecordingHook, TinyTrainer, make_batches, outline
from tests.tiers import DEVICES
from trainfsm import BaseHook, BaseTrainer

LR = 0.1


def sgd_reference(batches: list[dict[str, Any]], lr: float = LR) -> tuple[np.ndarray, np.ndarray]:
    """SGD on Linear(3, 1) with mean squared error, one step per batch, by the closed-form gradient
    in float64: dL/dW = 2/N (Wx + b - y)^T x, dL/db = 2/N sum(Wx + b - y)."""
    weight = np.array(INIT_WEIGHT, dtype=np.float64)
    bias = np.array(INIT_BIAS, dtype=np.float64)
    for batch in batches:
        x = batch["x"].double().numpy()
        y = batch["y"].double().numpy()
        residual = x @ weight.T + bias - y  # (N, 1)
        n = residual.size
        weight = weight - lr * (2.0 / n) * residual.T @ x
        bias = bias - lr * (2.0 / n) * residual.sum(axis=0)
    return weight, bias


def concat(batches: list[dict[str, Any]], index: int) -> dict[str, Any]:
    return {
        "i": index,
        "x": torch.cat([b["x"] for b in batches]),
        "y": torch.cat([b["y"] for b in batches]),
    }


def params(trainer: BaseTrainer) -> tuple[np.ndarray, np.ndarray]:
    model = trainer.unwrapped_model
    return model.weight.detach().double().cpu().numpy(), model.bias.detach().double().cpu().numpy()


def assert_params(trainer: BaseTrainer, expected: tuple[np.ndarray, np.ndarray], atol: float = 1e-6) -> None:
    weight, bias = params(trainer)
    np.testing.assert_allclose(weight, expected[0], rtol=0, atol=atol)
    np.testing.assert_allclose(bias, expected[1], rtol=0, atol=atol)


def cpu_fp16_supported() -> bool:
    try:
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            out = nn.Linear(3, 1)(torch.ones(2, 3))
        return scaler.is_enabled() and out.dtype == torch.float16
    except (RuntimeError, TypeError, ValueError):
        return False


needs_cpu_fp16 = pytest.mark.skipif(
    not cpu_fp16_supported(), reason="this torch build lacks CPU float16 autocast or a CPU GradScaler"
)


def needs_fp16(device: str) -> None:
    """Skip on CPU where this torch lacks float16 autocast or a CPU GradScaler (CUDA has both)."""
    if device == "cpu" and not cpu_fp16_supported():
        pytest.skip("this torch build lacks CPU float16 autocast or a CPU GradScaler")


# ---------------------------------------------------------------- plain SGD and accumulation
def test_plain_run_matches_hand_computed_sgd(make_trainer):
    batches = make_batches(3)
    trainer = make_trainer(max_steps=3, batches=batches)
    trainer.train()
    assert_params(trainer, sgd_reference(batches))


def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_b():
    k, b, steps = 3, 4, 2
    micro = make_batches(k * steps, batch_size=b, seed=1)
    full = [concat(micro[s * k : (s + 1) * k], s) for s in range(steps)]
    expected = sgd_reference(full)

    accumulated = TinyTrainer(max_steps=steps, batches=micro, gradient_accumulation_steps=k)
    accumulated.train()
    one_batch = TinyTrainer(max_steps=steps, batches=full)
    one_batch.train()

    assert_params(accumulated, expected)
    assert_params(one_batch, expected)
    assert_params(accumulated, params(one_batch))


def test_accumulated_step_loss_is_the_full_batch_loss():
    micro = make_batches(3, batch_size=4, seed=2)
    trainer = TinyTrainer(max_steps=1, batches=micro, gradient_accumulation_steps=3)
    trainer.train()
    full = concat(micro, 0)
    weight = torch.tensor(INIT_WEIGHT)
    bias = torch.tensor(INIT_BIAS)
    expected = nn.functional.mse_loss(full["x"] @ weight.T + bias, full["y"])
    step_loss = torch.stack(trainer.step_info["loss"]).mean()  # the micro-batches' losses
    assert step_loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_loss_none_micro_batches_do_not_touch_the_weights(make_trainer):
    batches = make_batches(4)
    trainer = make_trainer(max_steps=1, batches=batches, gradient_accumulation_steps=2, script={2: "none", 3: "none"})
    trainer.train()
    assert_params(trainer, sgd_reference([concat([batches[0], batches[3]], 0)]))


# ---------------------------------------------------------------- non-finite gradients
def test_retried_step_discards_the_non_finite_gradients(make_trainer):
    batches = make_batches(3)
    trainer = make_trainer(max_steps=2, batches=batches, max_non_finite_grad_retries=1, script={1: "nan"})
    trainer.train()
    # Batch 0 gave NaN gradients and was dropped; the two steps used batches 1 and 2.
    assert_params(trainer, sgd_reference(batches[1:3]))


def test_retry_is_taken_when_clipping_too(make_trainer, events):
    batches = make_batches(3)
    trainer = make_trainer(
        max_steps=2, batches=batches, grad_clip=1e6, max_non_finite_grad_retries=1, script={1: "nan"}
    )
    trainer.train()
    assert "non_finite:ACCUMULATE>RETRY" in outline(events())
    assert_params(trainer, sgd_reference(batches[1:3]))


def test_infinite_loss_is_non_finite_too(tmp_path, events):
    class InfTrainer(TinyTrainer):
        def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
            loss, records = super().forward(input)
            return (loss * float("inf") if self.calls == 1 else loss), records

    batches = make_batches(2)
    trainer = InfTrainer(max_steps=1, batches=batches, max_non_finite_grad_retries=1, workspace=tmp_path)
    trainer.train()
    assert "non_finite:ACCUMULATE>RETRY" in outline(events())
    assert trainer.step_info["non_finite_grad_retry_count"] == 1
    assert_params(trainer, sgd_reference(batches[1:2]))


# ---------------------------------------------------------------- clipping
def test_grad_norm_is_the_total_gradient_norm(make_trainer):
    batches = make_batches(1)
    trainer = make_trainer(max_steps=1, batches=batches, grad_clip=1e6)
    trainer.train()
    x, y = batches[0]["x"].double().numpy(), batches[0]["y"].double().numpy()
    weight, bias = np.array(INIT_WEIGHT), np.array(INIT_BIAS)
    residual = x @ weight.T + bias - y
    grad_w = (2.0 / residual.size) * residual.T @ x
    grad_b = (2.0 / residual.size) * residual.sum(axis=0)
    expected = np.sqrt((grad_w**2).sum() + (grad_b**2).sum())
    assert trainer.step_info["grad_norm"].item() == pytest.approx(expected, rel=1e-5)


def test_grad_clip_limits_the_update(make_trainer):
    batches = make_batches(1)
    clip = 0.01
    trainer = make_trainer(max_steps=1, batches=batches, grad_clip=clip)
    trainer.train()
    norm = trainer.step_info["grad_norm"].item()
    assert norm > clip  # the clip is active
    weight, bias = params(trainer)
    update = np.concatenate([(np.array(INIT_WEIGHT) - weight).ravel(), np.array(INIT_BIAS) - bias])
    assert np.linalg.norm(update) == pytest.approx(LR * clip, rel=1e-4)
    # Same direction as the unclipped SGD update.
    ref_w, ref_b = sgd_reference(batches)
    ref_update = np.concatenate([(np.array(INIT_WEIGHT) - ref_w).ravel(), np.array(INIT_BIAS) - ref_b])
    np.testing.assert_allclose(update / np.linalg.norm(update), ref_update / np.linalg.norm(ref_update), atol=1e-5)


# ---------------------------------------------------------------- LR scheduler
class LrTrace(BaseHook):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        assert trainer.optimizer is not None
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def test_scheduler_advances_once_per_optimizer_step(make_trainer):
    trace = LrTrace()
    trainer = make_trainer(max_steps=3, gradient_accumulation_steps=2, scheduler=halving, hooks=[trace])
    trainer.train()
    assert trace.lrs == [0.1, 0.05, 0.025]
    assert trainer.lr_scheduler.last_epoch == 3


def test_scheduler_is_not_advanced_by_retries(make_trainer):
    trace = LrTrace()
    trainer = make_trainer(
        max_steps=3, max_non_finite_grad_retries=2, script={2: "nan", 3: "nan"}, scheduler=halving, hooks=[trace]
    )
    trainer.train()
    assert trace.lrs == [0.1, 0.05, 0.025]
    assert trainer.lr_scheduler.last_epoch == 3
    assert trainer.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3


# ---------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_runs(make_trainer, device):
    batches = make_batches(3)
    trainer = make_trainer(max_steps=3, batches=batches, mixed_precision="bf16", device=device)
    trainer.train()
    assert trainer.autocast == [(True, torch.bfloat16)] * 3
    assert not trainer.grad_scaler.is_enabled()
    assert trainer.unwrapped_model.weight.dtype == torch.float32
    # bf16 has 8 bits of mantissa: close to the float64 reference, not equal.
    assert_params(trainer, sgd_reference(batches), atol=2e-2)
    weight, _ = params(trainer)
    assert not np.allclose(weight, np.array(INIT_WEIGHT))


def test_no_mixed_precision_runs_without_autocast(make_trainer):
    trainer = make_trainer(max_steps=1)
    trainer.train()
    assert trainer.autocast == [(False, torch.float32)]
    assert not trainer.grad_scaler.is_enabled()


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_autocast_and_grad_scaler_train(make_trainer, events, device):
    needs_fp16(device)
    batches = make_batches(3)
    trainer = make_trainer(max_steps=3, batches=batches, mixed_precision="fp16", device=device)
    trainer.train()
    assert trainer.autocast == [(True, torch.float16)] * 3
    assert trainer.grad_scaler.is_enabled()
    assert trainer.grad_scaler.get_scale() == 2.0**16  # no overflow, no growth yet
    assert_params(trainer, sgd_reference(batches), atol=2e-3)
    assert not [e for e in events() if e["event"] == "non_finite"]


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_scaler_skips_a_non_finite_step_without_retry(make_trainer, events, device):
    needs_fp16(device)
    weights: list[np.ndarray] = []

    class Weights(BaseHook):
        def on_after_step(self, trainer: BaseTrainer) -> None:
            weights.append(trainer.unwrapped_model.weight.detach().cpu().clone().numpy())

    trainer = make_trainer(max_steps=3, mixed_precision="fp16", script={2: "nan"}, hooks=[Weights()], device=device)
    trainer.train()  # max_non_finite_grad_retries is 0: the scaler, not RETRY, handles it
    assert outline(events()) == [
        "run_start",
        "built:BUILD>RESTORE",
        "data_layout",
        "restore",
        "restored:RESTORE>STEP",
        "micro:STEP>ACCUMULATE",
        "epoch",  # the first epoch's first batch (its fingerprint)
        "stepped:ACCUMULATE>STEP",
        "micro:STEP>ACCUMULATE",
        "non_finite:scaler_skip",
        "stepped:ACCUMULATE>STEP",
        "micro:STEP>ACCUMULATE",
        "finish:ACCUMULATE>EXIT",
        "exit:completed",
    ]
    (skip,) = [e for e in events() if e["event"] == "non_finite"]
    assert (skip["what"], skip["retry"], skip["max"], skip["scale"], skip["step"]) == ("scaler_skip", 0, 0, 65536.0, 2)
    np.testing.assert_array_equal(weights[1], weights[0])  # step 2 was skipped
    assert not np.array_equal(weights[2], weights[1])
    assert trainer.grad_scaler.get_scale() == 2.0**15  # backed off once
    assert trainer.seen == [0, 1, 2]


@needs_cpu_fp16
def test_fp16_scaler_skip_does_not_advance_the_scheduler(make_trainer):
    trace = LrTrace()
    trainer = make_trainer(max_steps=3, mixed_precision="fp16", script={2: "nan"}, scheduler=halving, hooks=[trace])
    trainer.train()
    assert trace.lrs == [0.1, 0.05, 0.05]
    assert trainer.lr_scheduler.last_epoch == 2


@needs_cpu_fp16
def test_fp16_scaler_skip_still_fires_step_hooks(make_trainer):
    log: list[tuple[str, str, int]] = []
    make_trainer(max_steps=2, mixed_precision="fp16", script={1: "nan"}, hooks=[RecordingHook(log)]).train()
    methods = [(m, s) for _, m, s in log if m in ("on_before_optimizer_step", "on_after_step")]
    assert methods == [
        ("on_before_optimizer_step", 1),
        ("on_after_step", 1),
        ("on_before_optimizer_step", 2),
        ("on_after_step", 2),
    ]
