"""Argument checks users hit first: constructor arguments, build methods, forward's result, and
trainer subclasses that shadow the machine's trigger names. Each error names what is wrong."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from tests.helpers import TinyTrainer
from trainfsm import BaseTrainer


def build(**kwargs):
    kwargs.setdefault("max_steps", 1)
    return TinyTrainer(**kwargs)


# ---------------------------------------------------------------- constructor arguments
INVALID = [
    # (argument, value, error type, message start)
    ("max_steps", 0, ValueError, "max_steps must be an int >= 1; got 0."),
    ("max_steps", -3, ValueError, "max_steps must be an int >= 1; got -3."),
    ("max_steps", None, TypeError, "max_steps must be an int >= 1; got None (NoneType)."),
    ("max_steps", 2.0, TypeError, "max_steps must be an int >= 1; got 2.0 (float)."),
    ("max_steps", "10", TypeError, "max_steps must be an int >= 1; got '10' (str)."),
    ("max_steps", True, TypeError, "max_steps must be an int >= 1; got True (bool)."),
    ("grad_clip", 0, ValueError, "grad_clip must be a positive finite float"),
    ("grad_clip", -1.0, ValueError, "grad_clip must be a positive finite float"),
    ("grad_clip", math.nan, ValueError, "grad_clip must be a positive finite float"),
    ("grad_clip", math.inf, ValueError, "grad_clip must be a positive finite float"),
    ("grad_clip", "1.0", TypeError, "grad_clip must be a positive float or None; got '1.0' (str)."),
    ("grad_clip", True, TypeError, "grad_clip must be a positive float or None; got True (bool)."),
    ("grad_clip", torch.tensor(1.0), TypeError, "grad_clip must be a positive float or None; got tensor(1.)"),
    ("max_non_finite_grad_retries", -1, ValueError, "max_non_finite_grad_retries must be an int >= 0 or None; got -1."),
    ("max_non_finite_grad_retries", 1.5, TypeError, "max_non_finite_grad_retries must be an int >= 0 or None; got 1.5"),
    ("max_non_finite_grad_retries", False, TypeError, "max_non_finite_grad_retries must be an int >= 0 or None"),
    ("mixed_precision", "fp32", ValueError, "mixed_precision must be one of 'fp16', 'bf16' or None; got 'fp32'."),
    ("mixed_precision", "FP16", ValueError, "mixed_precision must be one of 'fp16', 'bf16' or None; got 'FP16'."),
    ("mixed_precision", torch.float16, ValueError, "mixed_precision must be one of 'fp16', 'bf16' or None"),
    ("gradient_accumulation_steps", 0, ValueError, "gradient_accumulation_steps must be an int >= 1 or None; got 0."),
    ("gradient_accumulation_steps", "2", TypeError, "gradient_accumulation_steps must be an int >= 1 or None"),
    ("workspace", "", ValueError, "workspace must not be an empty string; pass None to write no files."),
    ("workspace", 3, TypeError, "workspace must be a str, a path or None; got 3 (int)."),
    ("workspace", b"runs", TypeError, "workspace must be a str, a path or None; got b'runs' (bytes)."),
    ("device", "nope", ValueError, "device 'nope' is not a valid torch device"),
    ("device", 1.5, TypeError, "device must be a torch.device, str, int or None; got 1.5 (float)."),
    ("device", True, TypeError, "device must be a torch.device, str, int or None; got True (bool)."),
    ("no_sync_accumulate", 1, TypeError, "no_sync_accumulate must be True or False; got 1 (int)."),
    ("no_sync_accumulate", None, TypeError, "no_sync_accumulate must be True or False; got None (NoneType)."),
    ("state_dict_options", {"full_state_dict": True}, TypeError, "state_dict_options must be a "),
    ("logger", "trainfsm", TypeError, "logger must be a logging.Logger or None; got 'trainfsm' (str)."),
    ("logger", print, TypeError, "logger must be a logging.Logger or None"),
]


@pytest.mark.parametrize(
    ("argument", "value", "error", "message"), INVALID, ids=[f"{a}={v!r}" for a, v, _, _ in INVALID]
)
def test_invalid_constructor_argument_raises_naming_it(argument, value, error, message):
    with pytest.raises(error) as info:
        build(**{argument: value})
    assert type(info.value) is error
    assert str(info.value).startswith(message)


def test_state_dict_options_error_names_the_expected_type():
    with pytest.raises(TypeError, match=r"torch\.distributed\.checkpoint\.state_dict\.StateDictOptions or None"):
        build(state_dict_options="full")


def test_device_error_suggests_valid_devices():
    with pytest.raises(ValueError, match=r"use e\.g\. 'cpu', 'cuda', 'cuda:1' or 0\.$"):
        build(device="nope")


def test_unhashable_mixed_precision_raises_naming_the_argument():
    with pytest.raises((TypeError, ValueError), match="mixed_precision"):
        build(mixed_precision=["bf16"])


def test_defaults_are_normalised():
    trainer = build(max_steps=5)
    assert trainer.max_steps == 5
    assert trainer.grad_clip is None
    assert trainer.max_non_finite_grad_retries == 0
    assert trainer.mixed_precision is None
    assert trainer.gradient_accumulation_steps == 1
    assert trainer.workspace is None
    assert trainer.device == torch.device("cpu")
    assert trainer.no_sync_accumulate is True
    assert trainer.state_dict_options is None
    assert trainer.logger is logging.getLogger("trainfsm")
    assert (trainer.step, trainer.epoch, trainer.step_info) == (0, 0, {})
    assert (trainer.exit_reason, trainer.exit_code) == (None, None)


def test_valid_arguments_are_kept_in_canonical_types(tmp_path):
    adapter = logging.LoggerAdapter(logging.getLogger("custom"), {})
    options = StateDictOptions(full_state_dict=False)
    trainer = build(
        grad_clip=2,
        max_non_finite_grad_retries=0,
        mixed_precision="bf16",
        gradient_accumulation_steps=4,
        workspace=str(tmp_path / "ws"),
        device="cpu",
        no_sync_accumulate=False,
        state_dict_options=options,
        logger=adapter,
    )
    assert trainer.grad_clip == 2.0 and type(trainer.grad_clip) is float
    assert trainer.max_non_finite_grad_retries == 0
    assert trainer.mixed_precision == "bf16"
    assert trainer.gradient_accumulation_steps == 4
    assert trainer.workspace == tmp_path / "ws" and isinstance(trainer.workspace, Path)
    assert trainer.no_sync_accumulate is False
    assert trainer.state_dict_options is options
    assert trainer.logger is adapter


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is CUDA where it exists")
def test_default_device_is_cpu_without_cuda():
    assert BaseTrainer(max_steps=1).device == torch.device("cpu")


def test_device_accepts_a_torch_device():
    assert build(device=torch.device("cpu")).device == torch.device("cpu")


def test_construction_writes_nothing(tmp_path):
    build(workspace=tmp_path / "ws")
    assert not (tmp_path / "ws").exists()


# ---------------------------------------------------------------- build methods, forward, reserved names
@pytest.mark.parametrize(
    "method", ["build_data_loader", "build_model", "build_optimizer", "build_grad_scaler", "build_hooks"]
)
def test_build_method_returning_none_raises_type_error(tmp_path, method):
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path)
    setattr(trainer, method, lambda: None)
    with pytest.raises(TypeError, match=rf"^{method}\(\) returned None; .*did you forget `return`"):
        trainer.train()


@pytest.mark.parametrize(
    ("method", "value", "expected"),
    [
        ("build_data_loader", 42, "Iterable"),
        ("build_model", lambda x: x, "Module"),
        ("build_optimizer", object(), "Optimizer"),
        ("build_hooks", "hooks", "list or tuple"),
    ],
)
def test_build_method_returning_the_wrong_type_raises_type_error(tmp_path, method, value, expected):
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path)
    setattr(trainer, method, lambda: value)
    with pytest.raises(TypeError, match=rf"^{method}\(\) must return a {expected}; got "):
        trainer.train()


def test_build_hooks_with_a_non_hook_raises_type_error(tmp_path):
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[object()])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^build_hooks\(\) must return a BaseHook; got object"):
        trainer.train()


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (torch.tensor(1.0), r"^forward\(\) must return a 2-tuple \(loss, records\); got Tensor\."),
        ((torch.tensor(1.0),), r"^forward\(\) must return a 2-tuple \(loss, records\); got tuple of length 1\."),
        ([torch.tensor(1.0), {}], r"^forward\(\) must return a 2-tuple \(loss, records\); got list\."),
        (
            (1.0, {}),
            r"^forward\(\) must return \(loss, records\) with loss a scalar torch\.Tensor or None; "
            r"got loss of type float\.",
        ),
    ],
)
def test_forward_returning_the_wrong_shape_raises_type_error(tmp_path, result, match):
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path)
    trainer.forward = lambda batch: result  # type: ignore[method-assign]
    with pytest.raises(TypeError, match=match):
        trainer.train()
    assert (trainer.exit_reason, trainer.exit_code) == ("failed", 1)


@pytest.mark.parametrize("name", ["save", "finish", "micro", "state"])
def test_subclass_shadowing_a_trigger_name_raises_at_train(tmp_path, name):
    cls = type("Shadowing", (TinyTrainer,), {name: lambda self: None})
    trainer = cls(max_steps=1, workspace=tmp_path)
    with pytest.raises(TypeError, match=rf"^Shadowing defines '{name}', which the trainer's state machine needs"):
        trainer.train()
    assert not (tmp_path / "logs").exists()
