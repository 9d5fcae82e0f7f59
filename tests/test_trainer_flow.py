"""The loop as users see it: exact audit-trail sequences, hook order, step_info, data epochs,
failures and exit reasons, driven through a tiny real trainer on CPU."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers import (
    RecordingHook,
    TinyTrainer,
    assert_valid_chain,
    make_batches,
    outline,
    transitions_of,
)
from trainfsm import BaseHook, BaseTrainer, LossNoneWarning

START = ["run_start", "built:BUILD>RESTORE", "data_layout", "restore", "restored:RESTORE>STEP"]
STEP = ["micro:STEP>ACCUMULATE", "stepped:ACCUMULATE>STEP"]
LAST_STEP = ["micro:STEP>ACCUMULATE", "finish:ACCUMULATE>EXIT", "exit:completed"]


def run_outline(events: list[dict[str, Any]]) -> list[str]:
    """``outline``, less the first epoch's ``epoch`` event (its first batch's fingerprint, for the data
    ledger), which follows the first draw of a run that draws; checked here, then left out."""
    names = outline(events)
    if "micro:STEP>ACCUMULATE" in names:
        first = names.index("micro:STEP>ACCUMULATE")
        assert names[first + 1] == "epoch", names
        del names[first + 1]
    return names


# ---------------------------------------------------------------- acceptance: exact sequences
def test_plain_run_audit_trail(make_trainer, events):
    trainer = make_trainer(max_steps=3)
    trainer.train()
    assert run_outline(events()) == [*START, *STEP, *STEP, *LAST_STEP]
    assert trainer.step == 3
    assert (trainer.exit_reason, trainer.exit_code) == ("completed", 0)
    assert trainer.seen == [0, 1, 2]


def test_plain_run_transition_steps_and_states(make_trainer, events):
    make_trainer(max_steps=2).train()
    rows = [(e["trigger"], e["step"], e["state"]) for e in events() if e["event"] == "transition"]
    # Recorded at the instant of the state change: `state` is the destination, and `step` is
    # advanced by entering STEP, so a transition out of STEP already carries the new step.
    assert rows == [
        ("built", 0, "RESTORE"),
        ("restored", 0, "STEP"),
        ("micro", 1, "ACCUMULATE"),
        ("stepped", 1, "STEP"),
        ("micro", 2, "ACCUMULATE"),
        ("finish", 2, "EXIT"),
    ]


def test_accumulation_of_three_audit_trail(make_trainer, events):
    trainer = make_trainer(max_steps=2, gradient_accumulation_steps=3)
    trainer.train()
    micro3 = ["micro:STEP>ACCUMULATE", "micro:ACCUMULATE>ACCUMULATE", "micro:ACCUMULATE>ACCUMULATE"]
    assert run_outline(events()) == [
        *START,
        *micro3,
        "stepped:ACCUMULATE>STEP",
        *micro3,
        "finish:ACCUMULATE>EXIT",
        "exit:completed",
    ]
    assert trainer.seen == [0, 1, 2, 3, 4, 5]


def test_loss_none_micro_batches_audit_trail(make_trainer, events):
    # Accumulation 2; calls 2 and 3 return loss=None and do not count towards the two micro-batches.
    trainer = make_trainer(max_steps=1, gradient_accumulation_steps=2, script={2: "none", 3: "none"})
    trainer.train()
    assert run_outline(events()) == [
        *START,
        "micro:STEP>ACCUMULATE",
        "micro:ACCUMULATE>ACCUMULATE",
        "loss_none",
        "micro:ACCUMULATE>ACCUMULATE",
        "loss_none",
        "micro:ACCUMULATE>ACCUMULATE",
        "finish:ACCUMULATE>EXIT",
        "exit:completed",
    ]
    loss_none = [e for e in events() if e["event"] == "loss_none"]
    assert [(e["micro"], e["step"], e["state"]) for e in loss_none] == [(1, 1, "ACCUMULATE"), (1, 1, "ACCUMULATE")]
    assert trainer.seen == [0, 1, 2, 3]


def test_loss_none_step_uses_only_batches_with_a_loss(make_trainer):
    trainer = make_trainer(max_steps=1, gradient_accumulation_steps=2, script={2: "none", 3: "none"})
    trainer.train()
    # step_info holds the two micro-batches that returned a loss (calls 1 and 4), not the skipped ones.
    assert [loss.item() for loss in trainer.step_info["loss"]] == pytest.approx(trainer.losses, rel=1e-6)
    assert len(trainer.losses) == 2
    assert [r["m"] for r in trainer.step_info["records"]] == [{"batch": 0}, {"batch": 3}]
    assert len(trainer.step_info["data_time"]) == 4  # every batch drawn, skipped ones too


def test_loss_none_does_not_warn_for_a_plain_module(make_trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossNoneWarning)
        make_trainer(max_steps=1, script={1: "none"}).train()


def test_retry_that_succeeds_audit_trail(make_trainer, events):
    trainer = make_trainer(max_steps=2, max_non_finite_grad_retries=2, script={1: "nan"})
    trainer.train()
    assert run_outline(events()) == [
        *START,
        "micro:STEP>ACCUMULATE",
        "non_finite:ACCUMULATE>RETRY",
        "non_finite:gradients",
        "retry:RETRY>ACCUMULATE",
        "stepped:ACCUMULATE>STEP",
        *LAST_STEP,
    ]
    (warning,) = [e for e in events() if e["event"] == "non_finite"]
    assert (warning["what"], warning["retry"], warning["max"], warning["step"], warning["state"]) == (
        "gradients",
        1,
        2,
        1,
        "RETRY",
    )
    # The retried step drew a fresh batch; the step count did not move.
    assert trainer.seen == [0, 1, 2]
    assert trainer.step == 2


def test_retry_with_accumulation_reruns_all_micro_batches_on_fresh_data(make_trainer, events):
    trainer = make_trainer(max_steps=1, gradient_accumulation_steps=2, max_non_finite_grad_retries=1, script={2: "nan"})
    trainer.train()
    assert transitions_of(events())[2:] == [
        ("micro", "STEP", "ACCUMULATE"),
        ("micro", "ACCUMULATE", "ACCUMULATE"),
        ("non_finite", "ACCUMULATE", "RETRY"),
        ("retry", "RETRY", "ACCUMULATE"),
        ("micro", "ACCUMULATE", "ACCUMULATE"),
        ("finish", "ACCUMULATE", "EXIT"),
    ]
    assert trainer.seen == [0, 1, 2, 3]
    assert trainer.step_info["non_finite_grad_retry_count"] == trainer.step_info["non_finite_grad_retries"] == 1
    # The step's losses are the retried micro-batches' only; its data times count every batch drawn.
    assert [loss.item() for loss in trainer.step_info["loss"]] == pytest.approx(trainer.losses[2:4], rel=1e-6)
    assert len(trainer.step_info["data_time"]) == 4


def test_retries_exhausted_audit_trail(make_trainer, events):
    log: list[tuple[str, str, int]] = []
    hook = RecordingHook(log)
    trainer = make_trainer(
        max_steps=3, max_non_finite_grad_retries=2, script={2: "nan", 3: "nan", 4: "nan"}, hooks=[hook]
    )
    with pytest.raises(RuntimeError) as info:
        trainer.train()
    assert run_outline(events()) == [
        *START,
        *STEP,
        "micro:STEP>ACCUMULATE",
        "non_finite:ACCUMULATE>RETRY",
        "non_finite:gradients",
        "retry:RETRY>ACCUMULATE",
        "non_finite:ACCUMULATE>RETRY",
        "non_finite:gradients",
        "retry:RETRY>ACCUMULATE",
        "non_finite:ACCUMULATE>RETRY",
        "exception:RuntimeError",
        "fail:RETRY>EXIT",
        "exit:failed",
    ]
    assert [e["retry"] for e in events() if e["event"] == "non_finite"] == [1, 2]
    (exit_event,) = [e for e in events() if e["event"] == "exit"]
    assert (exit_event["reason"], exit_event["code"], exit_event["step"]) == ("failed", 1, 2)
    message = str(info.value)
    assert message.startswith("Step 2: gradients were non-finite on 3 attempts (2 retries, ")
    assert "max_non_finite_grad_retries=2" in message
    # on_after_train still ran, and saw the failure.
    assert ("hook", "on_after_train", 2) in log
    assert hook.after_train_state == {"reason": "failed", "code": 1, "step": 2}
    assert (trainer.exit_reason, trainer.exit_code) == ("failed", 1)


@pytest.mark.parametrize("limit", [None, 0])
def test_non_finite_without_retries_raises_naming_the_step(make_trainer, events, limit):
    trainer = make_trainer(max_steps=3, max_non_finite_grad_retries=limit, script={2: "nan"})
    with pytest.raises(RuntimeError, match=r"^Step 2: gradients are non-finite and retries are disabled"):
        trainer.train()
    assert run_outline(events())[-5:] == [
        "micro:STEP>ACCUMULATE",
        "non_finite:ACCUMULATE>RETRY",
        "exception:RuntimeError",
        "fail:RETRY>EXIT",
        "exit:failed",
    ]
    assert not [e for e in events() if e["event"] == "non_finite"]


def test_exception_in_forward_is_recorded_and_reraised(make_trainer, events):
    trainer = make_trainer(max_steps=3, script={2: ValueError("boom in forward")})
    with pytest.raises(ValueError, match=r"^boom in forward$"):
        trainer.train()
    assert run_outline(events()) == [
        *START,
        *STEP,
        "micro:STEP>ACCUMULATE",
        "exception:ValueError",
        "fail:ACCUMULATE>EXIT",
        "exit:failed",
    ]
    (exc,) = [e for e in events() if e["event"] == "exception"]
    assert (exc["type"], exc["message"], exc["step"], exc["state"]) == (
        "ValueError",
        "boom in forward",
        2,
        "ACCUMULATE",
    )
    assert exc["traceback"].startswith("Traceback (most recent call last):")
    assert "in forward" in exc["traceback"]
    assert exc["traceback"].rstrip().endswith("ValueError: boom in forward")
    assert (trainer.exit_reason, trainer.exit_code) == ("failed", 1)


def test_exception_in_forward_still_calls_on_after_train(make_trainer):
    log: list[tuple[str, str, int]] = []
    hook = RecordingHook(log)
    trainer = make_trainer(max_steps=3, script={1: KeyError("k")}, hooks=[hook])
    with pytest.raises(KeyError):
        trainer.train()
    assert [m for _, m, _ in log][-2:] == ["on_after_train", "on_enter_exit"]
    assert hook.after_train_state == {"reason": "failed", "code": 1, "step": 1}


def test_exception_in_a_hook_fails_from_the_state_it_was_raised_in(make_trainer, events):
    class Boom(BaseHook):
        def on_before_step(self, trainer: BaseTrainer) -> None:
            if trainer.step == 2:
                raise OSError("hook failed")

    with pytest.raises(OSError, match="hook failed"):
        make_trainer(max_steps=3, hooks=[Boom()]).train()
    # The state had changed to STEP when its enter callbacks ran.
    assert run_outline(events())[-5:] == [
        "micro:STEP>ACCUMULATE",
        "stepped:ACCUMULATE>STEP",
        "exception:OSError",
        "fail:STEP>EXIT",
        "exit:failed",
    ]


def test_on_after_train_failure_is_raised_after_exit_is_recorded(make_trainer, events):
    class Boom(BaseHook):
        def on_after_train(self, trainer: BaseTrainer) -> None:
            raise ValueError("after train failed")

    later = RecordingHook([], name="later")
    with pytest.raises(ValueError, match="after train failed"):
        make_trainer(max_steps=1, hooks=[Boom(), later]).train()
    # The hooks after the failing one still ran, and the exit was recorded.
    assert later.after_train_state == {"reason": "completed", "code": 0, "step": 1}
    names = run_outline(events())
    assert names[names.index("finish:ACCUMULATE>EXIT") + 1] == "exception:ValueError"
    assert "exit:failed" in names  # train() raises, so the trail says the run failed


def test_on_after_train_failure_during_a_failure_keeps_the_original_error(make_trainer, events):
    class Boom(BaseHook):
        def on_after_train(self, trainer: BaseTrainer) -> None:
            raise ValueError("after train failed")

    with pytest.raises(KeyError):
        make_trainer(max_steps=2, script={1: KeyError("original")}, hooks=[Boom()]).train()
    assert run_outline(events())[-4:] == [
        "exception:KeyError",
        "fail:ACCUMULATE>EXIT",
        "exception:ValueError",
        "exit:failed",
    ]


def test_every_run_follows_the_transition_table(make_trainer, events):
    hook = RecordingHook([], checkpoint_at={2})
    trainer = make_trainer(
        max_steps=4,
        gradient_accumulation_steps=2,
        max_non_finite_grad_retries=1,
        script={3: "nan", 6: "none"},
        hooks=[hook],
    )
    trainer.train()
    assert_valid_chain(transitions_of(events()))


def test_train_twice_raises(make_trainer):
    trainer = make_trainer(max_steps=1)
    trainer.train()
    with pytest.raises(RuntimeError, match=r"^train\(\) was already called on this trainer"):
        trainer.train()


def test_unwrapped_model_before_train_raises(make_trainer):
    with pytest.raises(RuntimeError, match=r"^unwrapped_model is available once build_model\(\) ran"):
        _ = make_trainer().unwrapped_model


def test_loss_none_warns_for_a_ddp_model(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    class DDPTrainer(TinyTrainer):
        def build_model(self) -> torch.nn.Module:
            return DistributedDataParallel(super().build_model())

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = DDPTrainer(max_steps=1, workspace=tmp_path, script={1: "none"})
        with pytest.warns(LossNoneWarning, match=r"^forward\(\) returned loss=None for a DDP/FSDP model"):
            trainer.train()
    finally:
        dist.destroy_process_group()
    assert trainer.step == 1


# ---------------------------------------------------------------- hooks
def test_hook_methods_fire_in_documented_order(make_trainer):
    log: list[tuple[str, str, int]] = []
    make_trainer(max_steps=3, hooks=[RecordingHook(log, checkpoint_at={2})]).train()
    assert [(m, s) for _, m, s in log] == [
        ("on_exit_build", 0),
        ("on_enter_restore", 0),
        ("on_before_train", 0),
        ("on_exit_restore", 0),
        ("on_before_step", 1),
        ("on_enter_step", 1),
        ("on_exit_step", 1),
        ("on_enter_accumulate", 1),
        ("on_before_optimizer_step", 1),
        ("on_after_step", 1),
        ("on_exit_accumulate", 1),
        ("on_before_step", 2),
        ("on_enter_step", 2),
        ("on_exit_step", 2),
        ("on_enter_accumulate", 2),
        ("on_before_optimizer_step", 2),
        ("on_after_step", 2),
        ("on_exit_accumulate", 2),
        ("on_enter_checkpoint", 2),
        ("on_exit_checkpoint", 2),
        ("on_before_step", 3),
        ("on_enter_step", 3),
        ("on_exit_step", 3),
        ("on_enter_accumulate", 3),
        ("on_before_optimizer_step", 3),
        ("on_after_step", 3),
        ("on_exit_accumulate", 3),
        ("on_after_train", 3),
        ("on_enter_exit", 3),
    ]


def test_hooks_fire_in_list_order_per_callback(make_trainer):
    log: list[tuple[str, str, int]] = []
    make_trainer(max_steps=1, hooks=[RecordingHook(log, "a"), RecordingHook(log, "b")]).train()
    tail = [(h, m) for h, m, _ in log if m in ("on_before_optimizer_step", "on_after_step", "on_after_train")]
    assert tail == [
        ("a", "on_before_optimizer_step"),
        ("b", "on_before_optimizer_step"),
        ("a", "on_after_step"),
        ("b", "on_after_step"),
        ("a", "on_after_train"),
        ("b", "on_after_train"),
    ]


def test_checkpoint_request_goes_through_checkpoint_state(make_trainer, events):
    make_trainer(max_steps=3, hooks=[RecordingHook([], checkpoint_at={2})]).train()
    assert run_outline(events()) == [
        *START,
        *STEP,
        "micro:STEP>ACCUMULATE",
        "save:ACCUMULATE>CHECKPOINT",
        "resume:CHECKPOINT>STEP",
        *LAST_STEP,
    ]


def test_checkpoint_at_the_last_step_finishes_from_checkpoint(make_trainer, events):
    make_trainer(max_steps=1, hooks=[RecordingHook([], checkpoint_at={1})]).train()
    assert run_outline(events()) == [
        *START,
        "micro:STEP>ACCUMULATE",
        "save:ACCUMULATE>CHECKPOINT",
        "finish:CHECKPOINT>EXIT",
        "exit:completed",
    ]


def test_stop_request_exits_with_reason_stopped(make_trainer, events):
    log: list[tuple[str, str, int]] = []
    hook = RecordingHook(log, stop_at={2})
    trainer = make_trainer(max_steps=5, hooks=[hook])
    trainer.train()
    assert run_outline(events()) == [*START, *STEP, "micro:STEP>ACCUMULATE", "finish:ACCUMULATE>EXIT", "exit:stopped"]
    assert (trainer.step, trainer.exit_reason, trainer.exit_code) == (2, "stopped", 0)
    assert hook.after_train_state == {"reason": "stopped", "code": 0, "step": 2}


def test_stop_with_checkpoint_saves_then_finishes(make_trainer, events):
    make_trainer(max_steps=5, hooks=[RecordingHook([], stop_at={1}, checkpoint_at={1})]).train()
    assert run_outline(events())[-4:] == [
        "micro:STEP>ACCUMULATE",
        "save:ACCUMULATE>CHECKPOINT",
        "finish:CHECKPOINT>EXIT",
        "exit:stopped",
    ]


def test_retry_does_not_fire_on_before_step_again(make_trainer):
    log: list[tuple[str, str, int]] = []
    make_trainer(
        max_steps=2, max_non_finite_grad_retries=3, script={1: "nan", 2: "nan"}, hooks=[RecordingHook(log)]
    ).train()
    methods = [(m, s) for _, m, s in log]
    assert methods.count(("on_before_step", 1)) == 1
    assert methods.count(("on_enter_retry", 1)) == 2
    assert methods.count(("on_before_optimizer_step", 1)) == 1


def test_resume_at_max_steps_finishes_from_restore_without_stepping(make_trainer, events):
    first = TinyTrainer(max_steps=2)
    first.train()
    state = first.state_dict()
    weight = first.model.weight.detach().clone()

    class Load(BaseHook):
        def on_enter_restore(self, trainer: BaseTrainer) -> None:
            trainer.load_state_dict(state)

    log: list[tuple[str, str, int]] = []
    trainer = make_trainer(max_steps=2, hooks=[Load(), RecordingHook(log)])
    trainer.train()
    assert run_outline(events()) == [
        "run_start",
        "built:BUILD>RESTORE",
        "data_layout",
        "restore",
        "finish:RESTORE>EXIT",
        "exit:completed",
    ]
    assert trainer.step == 2
    assert trainer.seen == []
    torch.testing.assert_close(trainer.model.weight.detach(), weight, rtol=0, atol=0)
    assert [m for _, m, _ in log] == [
        "on_exit_build",
        "on_enter_restore",
        "on_before_train",
        "on_exit_restore",
        "on_after_train",
        "on_enter_exit",
    ]


def test_data_iterator_is_closed_when_training_fails(make_trainer):
    closed: list[int] = []

    class Stream:
        def __iter__(self) -> Iterator[Any]:
            try:
                yield from make_batches(10)
            finally:
                closed.append(1)

    with pytest.raises(ValueError):
        make_trainer(max_steps=3, batches=Stream(), script={2: ValueError("boom")}).train()
    assert closed == [1]


def test_a_finished_trainer_can_be_garbage_collected(make_trainer):
    trainer = make_trainer(max_steps=2, hooks=[RecordingHook([])])
    trainer.train()
    model = weakref.ref(trainer.model)
    ref = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert ref() is None
    assert model() is None


def test_log_and_log_images_reach_every_hook(make_trainer):
    calls: list[tuple[str, str, dict[str, Any], bool]] = []

    class Sink(BaseHook):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_log(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
            calls.append((self.name, "log", records, dry_run))

        def on_log_images(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
            calls.append((self.name, "images", records, dry_run))

    trainer = make_trainer(max_steps=1, hooks=[Sink("a"), Sink("b")])
    trainer.train()
    trainer.log({"x": 1})
    trainer.log_images({"img": 2}, dry_run=True)
    assert calls == [
        ("a", "log", {"x": 1}, False),
        ("b", "log", {"x": 1}, False),
        ("a", "images", {"img": 2}, True),
        ("b", "images", {"img": 2}, True),
    ]


# ---------------------------------------------------------------- step_info
def test_step_info_is_a_fresh_dict_per_step_with_the_documented_keys(make_trainer):
    infos: list[dict[str, Any]] = []
    at_before_step: list[dict[str, Any]] = []

    class Grab(BaseHook):
        def on_before_step(self, trainer: BaseTrainer) -> None:
            at_before_step.append(dict(trainer.step_info))

        def on_after_step(self, trainer: BaseTrainer) -> None:
            infos.append(trainer.step_info)

    make_trainer(max_steps=3, hooks=[Grab()]).train()
    assert at_before_step == [{}, {}, {}]
    assert len({id(info) for info in infos}) == 3
    for info in infos:
        assert set(info) == {
            "loss",
            "records",
            "data_time",
            "step_time",
            "non_finite_grad_retry_count",
            "non_finite_grad_retries",
        }
        (loss,) = info["loss"]  # trainloop's layout: one entry per micro-batch
        assert isinstance(loss, torch.Tensor) and not loss.requires_grad
        assert info["non_finite_grad_retry_count"] == 0
        (data_time,) = info["data_time"]
        assert data_time >= 0.0
        assert info["step_time"] >= data_time


def test_step_info_keeps_each_micro_batchs_records_and_loss(make_trainer):
    trainer = make_trainer(max_steps=1, gradient_accumulation_steps=3)
    trainer.train()
    assert [r["m"] for r in trainer.step_info["records"]] == [{"batch": 0}, {"batch": 1}, {"batch": 2}]
    assert [r["loss"] for r in trainer.step_info["records"]] == trainer.losses
    assert [loss.item() for loss in trainer.step_info["loss"]] == trainer.losses
    assert len(trainer.step_info["data_time"]) == 3


def test_step_info_records_without_accumulation_are_forwards_own(make_trainer):
    trainer = make_trainer(max_steps=2)
    trainer.train()
    assert trainer.step_info["records"] == [{"loss": trainer.losses[1], "m": {"batch": 1}}]
    assert [loss.item() for loss in trainer.step_info["loss"]] == [trainer.losses[1]]


def test_step_info_counts_retries_of_its_step(make_trainer):
    counts: list[int] = []

    class Grab(BaseHook):
        def on_after_step(self, trainer: BaseTrainer) -> None:
            counts.append(trainer.step_info["non_finite_grad_retry_count"])

    make_trainer(max_steps=3, max_non_finite_grad_retries=3, script={2: "nan", 3: "nan"}, hooks=[Grab()]).train()
    assert counts == [0, 2, 0]


def test_step_info_has_grad_norm_when_clipping(make_trainer):
    norms: list[torch.Tensor] = []

    class Grab(BaseHook):
        def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
            norms.append(trainer.step_info["grad_norm"])

    trainer = make_trainer(max_steps=2, grad_clip=1e6, hooks=[Grab()])
    trainer.train()
    assert len(norms) == 2
    assert trainer.step_info["grad_norm"] is norms[1]


def test_step_info_is_typed_and_still_trainloops_dict(make_trainer):
    import json

    from trainfsm.step_info import StepInfo

    trainer = make_trainer(max_steps=2, grad_clip=1e6, gradient_accumulation_steps=2)
    trainer.train()
    info = trainer.step_info
    assert isinstance(info, StepInfo) and isinstance(info, dict)
    assert info.loss is info["loss"] and len(info.loss) == 2
    assert info.records is info["records"] and info.data_time is info["data_time"]
    assert info.step_time == info["step_time"] > 0.0
    assert info.non_finite_grad_retries == info["non_finite_grad_retry_count"] == 0
    assert info.grad_norm is info["grad_norm"]
    assert info.max_memory is None and "max_memory" not in info  # no hook put it there
    plain = {k: v for k, v in info.items() if k not in ("loss", "grad_norm", "records")}
    assert json.loads(json.dumps(plain)) == plain  # what a logger does with it


def test_step_info_written_by_a_later_hook_is_there_for_an_earlier_ones_on_after_step(make_trainer):
    seen: list[Any] = []

    class Reader(BaseHook):
        def on_after_step(self, trainer: BaseTrainer) -> None:
            seen.append(trainer.step_info.get("tokens"))

    class Writer(BaseHook):
        def on_step_info(self, trainer: BaseTrainer, info: Any) -> None:
            info["tokens"] = 32 * trainer.step

    make_trainer(max_steps=3, hooks=[Reader(), Writer()]).train()  # the reader listed first
    assert seen == [32, 64, 96]


def test_on_step_info_runs_after_the_evaluations_and_before_the_questions(make_trainer):
    calls: list[str] = []

    class Both(BaseHook):
        def on_evaluate(self, trainer: BaseTrainer) -> None:
            calls.append("evaluate")

        def on_step_info(self, trainer: BaseTrainer, info: Any) -> None:
            calls.append("step_info")

        def wants_stop(self, trainer: BaseTrainer) -> bool:
            calls.append("wants_stop")
            return False

        def on_after_step(self, trainer: BaseTrainer) -> None:
            calls.append("after_step")

    make_trainer(max_steps=1, hooks=[Both()]).train()
    assert calls == ["evaluate", "step_info", "wants_stop", "after_step"]


# ---------------------------------------------------------------- data
class EpochLoader:
    """A re-iterable with set_epoch that records the epochs it was told."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def test_exhausted_loader_starts_a_new_epoch(make_trainer, events):
    loader = EpochLoader(make_batches(3))
    trainer = make_trainer(max_steps=7, batches=loader)
    trainer.train()
    assert loader.epochs == [0, 1, 2]
    assert [(e["epoch"], e["step"]) for e in events() if e["event"] == "epoch"] == [(0, 1), (1, 4), (2, 7)]
    assert trainer.epoch == 2
    assert trainer.seen == [0, 1, 2, 0, 1, 2, 0]


def test_max_epochs_ends_the_run_when_the_data_runs_out(make_trainer, events):
    loader = EpochLoader(make_batches(3))
    trainer = make_trainer(max_steps=100, batches=loader, max_epochs=2)
    trainer.train()
    assert trainer.seen == [0, 1, 2, 0, 1, 2]
    assert (trainer.step, trainer.epoch, loader.epochs) == (6, 1, [0, 1])
    assert (trainer.exit_reason, trainer.exit_code) == ("completed", 0)
    assert run_outline(events())[-6:] == [
        "stepped:ACCUMULATE>STEP",
        "micro:STEP>ACCUMULATE",  # step 7 begins and finds no data: it never happens
        "data_exhausted",
        "exhausted:ACCUMULATE>CHECKPOINT",
        "finish:CHECKPOINT>EXIT",
        "exit:completed",
    ]
    exhausted = [e for e in events() if e["event"] == "data_exhausted"]
    # Written by step 7, the one that found no data; the `exhausted` transition already carries 6.
    assert [(e["step"], e["epochs"], e["dropped_micro_batches"]) for e in exhausted] == [(7, 2, 0)]
    assert [e["step"] for e in events() if e.get("trigger") == "exhausted"] == [6]


def test_max_epochs_drops_an_incomplete_last_step(make_trainer, events):
    trainer = make_trainer(max_steps=100, batches=make_batches(4), max_epochs=2, gradient_accumulation_steps=3)
    trainer.train()
    assert trainer.seen == [0, 1, 2, 3, 0, 1, 2, 3]  # 8 micro-batches: steps of 3, 3, then 2 dropped
    assert trainer.step == 2
    assert [e["dropped_micro_batches"] for e in events() if e["event"] == "data_exhausted"] == [2]
    assert all(p.grad is None for p in trainer.model.parameters())


def test_max_steps_still_ends_a_run_before_max_epochs(make_trainer, events):
    trainer = make_trainer(max_steps=4, batches=make_batches(3), max_epochs=5)
    trainer.train()
    assert (trainer.step, trainer.epoch) == (4, 1)
    assert not [e for e in events() if e["event"] == "data_exhausted"]
    assert run_outline(events())[-2:] == ["finish:ACCUMULATE>EXIT", "exit:completed"]


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_max_epochs_must_be_a_positive_int_or_none(value, error):
    with pytest.raises(error, match=r"max_epochs must be an int >= 1 or None; got"):
        TinyTrainer(max_steps=1, max_epochs=value)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_loss_none_agreement_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"loss_none_agreement must be"):
        TinyTrainer(max_steps=1, loss_none_agreement=value)


def test_a_single_process_counts_its_loss_none_skips(make_trainer):
    trainer = make_trainer(max_steps=2, script={1: "none"}, loss_none_agreement=True)
    trainer.train()
    assert trainer.loss_none_skips == 1 and trainer.step == 2


def test_set_epoch_is_called_on_the_sampler_of_a_data_loader(make_trainer):
    class Sampler(torch.utils.data.Sampler[int]):
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

        def __len__(self) -> int:
            return 4

    sampler = Sampler()
    dataset = torch.utils.data.TensorDataset(torch.arange(4))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)

    class LoaderTrainer(TinyTrainer):
        def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
            (index,) = input
            return super().forward(make_batches(4)[int(index[0])])

    trainer = LoaderTrainer(max_steps=5, batches=loader, workspace=None)
    trainer.train()
    assert sampler.epochs == [0, 1, 2]
    assert trainer.seen == [0, 2, 0, 2, 0]


def test_set_epoch_is_called_on_the_batch_sampler_of_a_data_loader():
    class BatchSampler(torch.utils.data.Sampler[list[int]]):
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self) -> Iterator[list[int]]:
            return iter([[0, 1], [2, 3]])

        def __len__(self) -> int:
            return 2

    batch_sampler = BatchSampler()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_sampler=batch_sampler)

    class LoaderTrainer(TinyTrainer):
        def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
            (index,) = input
            return super().forward(make_batches(4)[int(index[0])])

    LoaderTrainer(max_steps=3, batches=loader, workspace=None).train()
    assert batch_sampler.epochs == [0, 1]


def test_exhausted_one_shot_iterator_raises(make_trainer, events):
    trainer = make_trainer(max_steps=3, batches=iter(make_batches(2)))
    with pytest.raises(RuntimeError, match=r"^build_data_loader\(\) returned an iterable that yields no batches"):
        trainer.train()
    assert run_outline(events())[-3:] == ["exception:RuntimeError", "fail:ACCUMULATE>EXIT", "exit:failed"]
    assert trainer.step == 3
    assert trainer.seen == [0, 1]


def test_data_iterator_is_closed_at_exit(make_trainer):
    closed: list[int] = []

    class Stream:
        def __iter__(self) -> Iterator[Any]:
            try:
                yield from make_batches(10)
            finally:
                closed.append(1)

    make_trainer(max_steps=2, batches=Stream()).train()
    assert closed == [1]


# ---------------------------------------------------------------- state_dict / load_state_dict
class Extra(BaseHook):
    """Adds its own key to the state and records what it is given back."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def on_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        state_dict["extra"] = {"calls": trainer.step}

    def on_load_state_dict(self, trainer: BaseTrainer, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict["extra"]


class LoadOnRestore(BaseHook):
    """Loads ``state`` in RESTORE, as a checkpoint hook does."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def on_enter_restore(self, trainer: BaseTrainer) -> None:
        trainer.load_state_dict(self.state)


def momentum_sgd(trainer: TinyTrainer) -> torch.optim.Optimizer:
    assert trainer.model is not None
    return torch.optim.SGD(trainer.model.parameters(), lr=0.1, momentum=0.9)


class MomentumTrainer(TinyTrainer):
    def build_optimizer(self) -> torch.optim.Optimizer:
        return momentum_sgd(self)


def test_state_dict_has_the_documented_keys_and_hook_additions(make_trainer):
    trainer = make_trainer(max_steps=3, batches=make_batches(2), hooks=[Extra()])
    trainer.train()
    state = trainer.state_dict()
    assert set(state) == {"model", "optimizer", "lr_scheduler", "grad_scaler", "step", "epoch", "rank_state", "extra"}
    assert set(state["rank_state"]) == {"rng", "data", "loss_none_skips"}
    assert (state["rank_state"]["data"]["epoch"], state["rank_state"]["data"]["batches"]) == (1, 1)
    assert (state["step"], state["epoch"], state["lr_scheduler"], state["extra"]) == (3, 1, None, {"calls": 3})
    assert set(state["model"]) == {"weight", "bias"}
    torch.testing.assert_close(state["model"]["weight"], trainer.model.weight.detach(), rtol=0, atol=0)


def test_state_dict_before_train_raises():
    with pytest.raises(RuntimeError, match=r"^state_dict\(\) needs the built model and optimizer"):
        TinyTrainer(max_steps=1).state_dict()


def test_resumed_training_matches_uninterrupted_training(tmp_path, events):
    def scheduler(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    batches = make_batches(4)
    straight = MomentumTrainer(max_steps=4, batches=batches, scheduler=scheduler)
    straight.train()

    first = MomentumTrainer(max_steps=2, batches=batches[:2], scheduler=scheduler, hooks=[Extra()])
    first.train()
    state = first.state_dict()
    extra = Extra()
    resumed = MomentumTrainer(
        max_steps=4,
        batches=batches[2:],
        scheduler=scheduler,
        hooks=[LoadOnRestore(state), extra],
        workspace=tmp_path,
    )
    resumed.train()

    assert resumed.step == 4
    assert resumed.seen == [2, 3]
    for a, b in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert resumed.lr_scheduler.last_epoch == straight.lr_scheduler.last_epoch == 4
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    assert extra.loaded == {"calls": 2}
    restore = next(e for e in events() if e["event"] == "restore")
    assert (restore["resumed"], restore["from_step"]) == (True, 2)


def test_load_state_dict_lets_the_optimizer_have_the_last_word_on_learning_rates(make_trainer):
    class Meddling(torch.optim.lr_scheduler.LambdaLR):
        """A scheduler whose load writes its own view of the learning rate into the param groups."""

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            for group in self.optimizer.param_groups:
                group["lr"] = 123.0

    def halve(optimizer: torch.optim.Optimizer) -> Any:
        return Meddling(optimizer, lambda epoch: 0.5**epoch)

    first = TinyTrainer(max_steps=2, scheduler=halve)
    first.train()
    state = first.state_dict()
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.025

    trainer = make_trainer(max_steps=2, scheduler=halve, hooks=[LoadOnRestore(state)])
    trainer.train()  # resumes at max_steps: loads, then finishes
    assert trainer.optimizer.param_groups[0]["lr"] == 0.025
    assert trainer.lr_scheduler.last_epoch == 2


def test_log_scalars_and_on_log_scalars_are_aliases_of_log_and_on_log(make_trainer) -> None:
    from trainfsm import BaseHook

    seen: list[tuple[str, dict]] = []

    class Old(BaseHook):
        def on_log_scalars(self, trainer, records, dry_run=False):
            seen.append(("old", records))

    class New(BaseHook):
        def on_log(self, trainer, records, dry_run=False):
            seen.append(("new", records))

    class Logs(BaseHook):
        def on_after_step(self, trainer):
            trainer.log({"a": 1})
            trainer.log_scalars({"b": 2})

    make_trainer(max_steps=1, hooks=[Old(), New(), Logs()]).train()
    assert seen == [("old", {"a": 1}), ("new", {"a": 1}), ("old", {"b": 2}), ("new", {"b": 2})]
