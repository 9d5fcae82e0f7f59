"""The non-finite guard's check itself: every gradient, large (summed) or small (fused), is read."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainfsm.finite import CPU_SUM_MIN_ELEMENTS, FiniteCheck


def model_with_grads(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # 784x128: one weight above the summing threshold; the two biases and 10x128 below it.
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)).to(dtype)
    model(torch.randn(4, 784, dtype=dtype)).float().sum().backward()
    return model


def test_large_cpu_gradients_are_summed_and_small_ones_share_one_fused_pass():
    params = list(model_with_grads().parameters())
    check = FiniteCheck(params)
    assert params[0].numel() >= CPU_SUM_MIN_ELEMENTS
    assert [(p.params, p.summed, p.summed_in_float32) for p in check._passes] == [(params[1:], [params[0]], [])]


def test_clean_gradients_pass():
    check = FiniteCheck(list(model_with_grads().parameters()))
    assert check() is False
    assert check() is False


@pytest.mark.parametrize("index", [0, 1, 2, 3], ids=["weight0-summed", "bias0-fused", "weight1-fused", "bias1-fused"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_element_in_any_gradient_is_caught_on_the_step_it_appears(index, bad):
    params = list(model_with_grads().parameters())
    check = FiniteCheck(params)
    grad = params[index].grad
    kept = grad.clone()
    grad.view(-1)[-1] = bad
    assert check() is True
    grad.copy_(kept)  # the next step's gradients are clean again: the flag does not stick
    assert check() is False


def test_the_check_leaves_every_gradient_bit_identical():
    params = list(model_with_grads().parameters())
    params[1].grad[0] = -0.0  # the fused pass multiplies by exactly 1.0: even the sign of zero stays
    before = [param.grad.clone() for param in params]
    FiniteCheck(params)()
    for param, kept in zip(params, before, strict=True):
        assert torch.equal(param.grad.view(torch.int32), kept.view(torch.int32))


def test_a_large_gradient_whose_sum_overflows_counts_as_non_finite():
    params = list(model_with_grads().parameters())
    params[0].grad.fill_(3e38)  # every element finite, the sum is not: stepping it would be as wrong
    assert FiniteCheck(params)() is True


def test_low_precision_cpu_gradients_are_summed_in_float32():
    params = list(model_with_grads(torch.bfloat16).parameters())
    check = FiniteCheck(params)
    assert [(p.params, p.summed, p.summed_in_float32) for p in check._passes] == [([], [], params)]
    params[3].grad[0] = math.inf
    assert check() is True


def test_parameters_without_gradients_are_skipped():
    params = list(model_with_grads().parameters())
    params[0].grad = None
    params[2].grad = None
    check = FiniteCheck(params)
    assert check() is False
    params[1].grad[0] = math.nan
    assert check() is True


def test_a_step_reads_one_flag_however_many_gradients_are_summed(monkeypatch):
    params = list(model_with_grads().parameters())
    check = FiniteCheck(params)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or item(self))
    assert check() is False
    assert len(reads) == 1
    params[0].grad.view(-1)[0] = math.nan
    assert check() is True
    assert len(reads) == 2


def test_without_the_fused_kernel_on_cpu_every_gradient_is_summed_and_read(monkeypatch):
    monkeypatch.setattr("trainfsm.finite._fused_check_runs_on_cpu", lambda: False)
    params = list(model_with_grads().parameters())
    check = FiniteCheck(params)
    assert check._read_each == [(param, False) for param in params] and check._passes == []
    assert check() is False
    params[2].grad[0, 0] = math.inf
    assert check() is True
