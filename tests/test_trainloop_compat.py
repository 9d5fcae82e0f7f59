"""Code written exactly as a ``trainloop`` user writes it runs unchanged on trainfsm: hooks that read
``trainer.step_info``, consume ``on_log`` records, subclass ``StatsHook``; ``key_average``. Values
and keys are asserted exactly (trainloop 0.5.x for the documented hooks, 0.11 for ``StatsHook`` /
``TrainingStats``), with accumulation, a non-finite retry, clipping and an lr scheduler.

The model is the one trainloop's own tests use: ``Linear(1, 1, bias=False)`` at weight 1, SGD at
lr 0.1, the input ``ones(1, 1)`` forever, so every number can be worked out by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from trainfsm import BaseHook, BaseTrainer, LoggingHook, StatsHook, TrainingStats, key_average


def ones() -> Iterator[torch.Tensor]:
    while True:
        yield torch.ones(1, 1)


class Forever:
    """An endless iterable (re-iterable, as trainfsm asks of a data loader)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return ones()


class UserTrainer(BaseTrainer):
    """As a trainloop user writes one; ``poison`` lists forward calls whose loss is made infinite."""

    def __init__(
        self,
        *args: Any,
        hooks: list[BaseHook] = (),
        poison: tuple[int, ...] = (),
        scheduler: bool = False,
        groups: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(*args, **kwargs)
        self.hook_list = list(hooks)
        self.poison = poison
        self.use_scheduler = scheduler
        self.groups = groups
        self.calls = 0
        self.logged: list[dict[str, Any]] = []

    def build_data_loader(self) -> Any:
        return Forever()

    def build_model(self) -> nn.Module:
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        return model

    def build_optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None
        if self.groups:
            return torch.optim.SGD([{"params": self.model.parameters(), "name": "model", "lr": 0.1}], momentum=0.0)
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def build_lr_scheduler(self) -> Any:
        if not self.use_scheduler:
            return None
        return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)  # type: ignore[arg-type]

    def build_hooks(self) -> list[BaseHook]:
        return self.hook_list

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        self.calls += 1
        loss = self.model(input).pow(2).mean()  # type: ignore[misc]
        if self.calls in self.poison:
            loss = loss * float("inf")
        return loss, {"metric": 1.0, "call": float(self.calls)}

    def log(self, records: dict[str, Any], dry_run: bool = False) -> None:  # a user's own sink
        self.logged.append(records)
        super().log(records, dry_run)


class StepInfoReader(BaseHook):
    """A trainloop user's hook: reads step_info in on_after_step, the way trainloop documents it."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_after_step(self, trainer: BaseTrainer) -> None:
        info = trainer.step_info
        self.seen.append(
            {
                "losses": [loss.item() for loss in info["loss"]],
                "records": [dict(r) for r in info["records"]],
                "data_times": len(info["data_time"]),
                "step_time": info["step_time"],
                "retries": info["non_finite_grad_retry_count"],
                "grad_norm": info["grad_norm"].item() if "grad_norm" in info else None,
            }
        )


# ---------------------------------------------------------------- step_info
def test_step_info_holds_each_micro_batchs_loss_and_records_with_accumulation() -> None:
    reader = StepInfoReader()
    UserTrainer(max_steps=1, gradient_accumulation_steps=2, hooks=[reader]).train()
    (step,) = reader.seen
    assert step["losses"] == [1.0, 1.0]  # w = 1: (1 * 1)**2, the raw loss of each micro-batch
    assert step["records"] == [{"metric": 1.0, "call": 1.0}, {"metric": 1.0, "call": 2.0}]
    assert step["data_times"] == 2 and isinstance(step["step_time"], float)
    assert step["retries"] == 0 and step["grad_norm"] is None


def test_step_info_counts_a_non_finite_retry_and_keeps_only_the_retried_micro_batches() -> None:
    reader = StepInfoReader()
    trainer = UserTrainer(max_steps=1, max_non_finite_grad_retries=1, poison=(1,), hooks=[reader])
    trainer.train()
    (step,) = reader.seen
    assert step["retries"] == 1
    assert trainer.step_info["non_finite_grad_retry_count"] == 1
    assert step["losses"] == [1.0] and step["records"] == [{"metric": 1.0, "call": 2.0}]
    assert step["data_times"] == 2  # the retried batch's draw was time spent in this step too


def test_step_info_grad_norm_is_the_norm_before_clipping() -> None:
    reader = StepInfoReader()
    UserTrainer(max_steps=1, grad_clip=0.5, hooks=[reader]).train()
    # d/dw (w * 1)**2 = 2w = 2 at w = 1: the norm before clipping is 2, clipped to 0.5.
    assert reader.seen[0]["grad_norm"] == pytest.approx(2.0)


# ---------------------------------------------------------------- LoggingHook records
def test_logging_hook_passes_one_train_section_with_trainloops_keys() -> None:
    trainer = UserTrainer(max_steps=2, grad_clip=10.0, hooks=[LoggingHook(interval=2)])
    trainer.train()
    (records,) = trainer.logged
    assert list(records) == ["train"]
    train = records["train"]
    assert set(train) == {
        "call",
        "metric",
        "grad_norm",
        "loss",
        "data_time",
        "step_time",
        "non_finite_grad_retry_count",
        "lr",
    }
    assert train["metric"] == 1.0 and train["call"] == 1.5
    # w: 1 -> 1 - 0.1 * 2 = 0.8; losses 1 and 0.64; grad norms 2 and 1.6
    assert train["loss"] == pytest.approx((1.0 + 0.64) / 2)
    assert train["grad_norm"] == pytest.approx((2.0 + 1.6) / 2)
    assert train["non_finite_grad_retry_count"] == 0.0
    assert train["lr"] == {"group_0": 0.1}
    assert all(type(v) is float for k, v in train.items() if k != "lr")


def test_logging_hook_lr_is_the_rate_the_step_used_before_the_scheduler_stepped() -> None:
    trainer = UserTrainer(max_steps=2, scheduler=True, hooks=[LoggingHook(interval=1, sync=False)])
    trainer.train()
    assert [r["train"]["lr"]["group_0"] for r in trainer.logged] == [0.1, 0.05]


def test_logging_hook_names_a_group_by_its_name() -> None:
    trainer = UserTrainer(max_steps=1, groups=True, hooks=[LoggingHook(interval=1)])
    trainer.train()
    assert trainer.logged[0]["train"]["lr"] == {"model": 0.1}


def test_logging_hook_retry_count_is_averaged_over_the_interval() -> None:
    trainer = UserTrainer(max_steps=2, max_non_finite_grad_retries=1, poison=(1,), hooks=[LoggingHook(interval=2)])
    trainer.train()
    assert trainer.logged[0]["train"]["non_finite_grad_retry_count"] == 0.5
    once = UserTrainer(max_steps=1, max_non_finite_grad_retries=1, poison=(1,), hooks=[LoggingHook(interval=1)])
    once.train()
    assert once.logged[0]["train"]["non_finite_grad_retry_count"] == 1.0


def test_a_users_on_log_hook_sees_the_same_records() -> None:
    class Sink(BaseHook):
        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []

        def on_log(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
            self.records.append(records)

    sink = Sink()
    trainer = UserTrainer(max_steps=2, hooks=[LoggingHook(interval=1), sink])
    trainer.train()
    assert sink.records == trainer.logged
    assert [r["train"]["loss"] for r in sink.records] == pytest.approx([1.0, 0.64])


# ---------------------------------------------------------------- StatsHook / TrainingStats (0.11)
def test_stats_hook_calls_back_with_training_stats() -> None:
    got: list[tuple[int, TrainingStats]] = []
    hook = StatsHook(lambda trainer, stats: got.append((trainer.step, stats)), interval=1)
    UserTrainer(max_steps=2, scheduler=True, hooks=[hook]).train()
    assert [step for step, _ in got] == [1, 2]
    first = got[0][1]
    assert first.loss == 1.0 and first.grad_norm is None and first.cuda_max_memory is None
    assert first.non_finite_grad_retries == 0.0 and first.records == {"call": 1.0, "metric": 1.0}
    assert [stats.param_groups for _, stats in got] == [[{"lr": 0.1}], [{"lr": 0.05}]]  # no "name" unless set
    assert isinstance(first.step_time, float) and isinstance(first.data_time, float)


def test_stats_hook_param_group_keys_pick_what_each_group_reports() -> None:
    got: list[TrainingStats] = []
    hook = StatsHook(lambda trainer, stats: got.append(stats), interval=1, param_group_keys=("name", "lr", "momentum"))
    UserTrainer(max_steps=1, groups=True, hooks=[hook]).train()
    assert got[0].param_groups == [{"name": "model", "lr": 0.1, "momentum": 0.0}]


def test_a_stats_hook_subclass_overrides_on_stats() -> None:
    class Collect(StatsHook):
        def __init__(self) -> None:
            super().__init__(interval=2, sync=False)
            self.losses: list[float] = []

        def on_stats(self, trainer: BaseTrainer, stats: TrainingStats) -> None:
            self.losses.append(stats.loss)

    hook = Collect()
    UserTrainer(max_steps=3, hooks=[hook]).train()
    # steps 1-2 then the tail, step 3; w: 1, 0.8, 0.64 -> losses 1, 0.64, 0.4096
    assert hook.losses == pytest.approx([(1.0 + 0.64) / 2, 0.4096])


def test_stats_hook_without_callback_or_override_is_refused() -> None:
    with pytest.raises(TypeError, match="StatsHook needs a callback"):
        StatsHook()
    with pytest.raises(TypeError, match="param_group_keys must be a sequence"):
        StatsHook(print, param_group_keys="lr")


# ---------------------------------------------------------------- key_average
def test_key_average_as_trainloop_has_it() -> None:
    records = [{"loss": 0.5, "metrics": {"acc": 0.9}}, {"loss": 0.6, "metrics": {"acc": 0.85}}]
    assert key_average(records) == {"loss": pytest.approx(0.55), "metrics": {"acc": pytest.approx(0.875)}}
    assert list(key_average([{"b": 1, "a": 2}])) == ["a", "b"]  # sorted keys
    assert key_average([{"a": 1}, {"b": 2}]) == {"a": 1.0, "b": 2.0}
    assert key_average([{"a": None}, {"a": 4}]) == {"a": 4.0}
    assert math.isnan(key_average([{"a": float("nan")}, {"a": 1.0}])["a"])
    assert key_average([{"a": float("nan")}, {"a": 1.0}], exclude_nan=True) == {"a": 1.0}
    assert math.isnan(key_average([{"a": float("nan")}], exclude_nan=True)["a"])
    assert key_average([]) == {}


def test_key_average_of_tensors_excluding_nan_stays_on_the_device() -> None:
    out = key_average([{"a": torch.tensor(float("nan"))}, {"a": torch.tensor(3.0)}], exclude_nan=True)
    assert isinstance(out["a"], torch.Tensor) and out["a"].item() == 3.0


# ---------------------------------------------------------------- bad forward() returns
def test_records_that_are_not_a_mapping_are_refused_by_name() -> None:
    class ListRecords(UserTrainer):
        def forward(self, input: torch.Tensor) -> Any:
            loss, _ = super().forward(input)
            return loss, [1.0]

    with pytest.raises(TypeError, match=r"records a dict of numbers .*got records of type list"):
        ListRecords(max_steps=1).train()


def test_a_non_scalar_loss_is_refused_with_its_shape() -> None:
    class VectorLoss(UserTrainer):
        def forward(self, input: torch.Tensor) -> Any:
            return self.model(input.expand(3, 1)).pow(2).squeeze(1), {}  # type: ignore[misc]

    with pytest.raises(ValueError, match=r"scalar loss .* shape \(3,\)\. Reduce it first"):
        VectorLoss(max_steps=1).train()
