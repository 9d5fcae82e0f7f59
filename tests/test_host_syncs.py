"""Host reads of tensor values on the routine step path, counted on CPU (issue 50, item 2).

The design promises no host sync the work does not need: per optimizer step the finite guard's one
read (``Stepper.check_and_clip``), none on micro-batches that only accumulate, and a hook's reads
only at its interval. On a GPU each read stalls the host until the device catches up; here on CPU
nothing stalls, so these tests count the reads instead (``tests/host_syncs.py``) and compare each
step of a steady-state window with the documented list, read by read, named by the frame that made
it. The window opens at the first hook's ``on_before_step`` of step ``FIRST`` (warm-up, BUILD and
RESTORE before it) and closes at that of step ``LAST + 1`` (EXIT after it). The counts are in
docs/guides/performance.md, "Host syncs per step".
"""

from __future__ import annotations

import math
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import TinyTrainer, make_batches
from tests.host_syncs import READS, HostReads, Read
from tests.test_numerics import needs_cpu_fp16
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook
from trainfsm.hooks.ema import EmaHook
from trainfsm.hooks.logging_hook import LoggingHook
from trainfsm.hooks.progress import ProgressHook
from trainfsm.hooks.stats import StatsHook
from trainfsm.hooks.validation import ValidationHook

#: Frames are named by ``co_qualname`` ("Stepper.check_and_clip.<locals>.<genexpr>"), new in 3.11.
pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="names frames by code.co_qualname (Python 3.11+)")

#: The counted steps: after five of warm-up (the fp16 scaler's first skip is at step 4 here), eight
#: steps, so an interval of 4 fires twice inside (steps 8 and 12).
FIRST, LAST = 6, 13
INTERVAL = 4

Key = tuple[str, str]  # (blame, method): see tests/host_syncs.Read.key
Part = str | int  # "before" (STEP: on_before_step), 1.. (the micro-batch), "CHECKPOINT", ...

# ---------------------------------------------------------------- the documented reads
#: The finite guard without grad_clip or scaler: the fused check's one flag.
GUARD: Key = ("src/trainfsm/finite.py:FiniteCheck.__call__", "Tensor.item")
#: With grad_clip: the total norm clipping computes is the check.
GUARD_CLIP: Key = ("src/trainfsm/step.py:Stepper.check_and_clip", "Tensor.__bool__")
#: With the fp16 scaler (no grad_clip): the flag ``unscale_`` already set, one per device.
GUARD_SCALER: Key = ("src/trainfsm/step.py:Stepper.check_and_clip.<locals>.<genexpr>", "Tensor.__bool__")
#: A StatsHook (LoggingHook, ProgressHook) at its interval: each tensor value cast on its device
#: (``.to(device=<the loss's device>, dtype=float64)``: counted on CPU, no sync on a GPU), then the
#: interval's one device-to-host copy.
STATS_CAST: Key = ("src/trainfsm/hooks/stats.py:IntervalStats._to_floats", "Tensor.to")
STATS_COPY: Key = ("src/trainfsm/hooks/stats.py:IntervalStats._to_floats", "Tensor.tolist")
#: ValidationHook at an evaluation: each result's value.
VALIDATION_VALUE: Key = ("src/trainfsm/hooks/validation.py:_scalar_to_float", "Tensor.item")
#: The data ledger fingerprints each epoch's first batch and the batch after a save: per tensor
#: leaf of the batch as the loader yields it (host memory for a DataLoader), a ``cpu`` and a ``numpy``.
FINGERPRINT: list[Key] = [
    ("src/trainfsm/data_cursor.py:fingerprint.<locals>.feed", "Tensor.cpu"),
    ("src/trainfsm/data_cursor.py:fingerprint.<locals>.feed", "Tensor.numpy"),
]
TENSOR_LEAVES = 2  # make_batches: {"i": int, "x": tensor, "y": tensor}


class SyncTrainer(TinyTrainer):
    """TinyTrainer whose ``forward`` reads nothing on the host (its records stay tensors, as the
    contract allows), and which says where the run stands for each read."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("batches", make_batches(64))  # no epoch boundary in the window
        super().__init__(**kwargs)
        self.micro_batch = 0  # forward calls in ``self.micro_batch_step`` so far
        self.micro_batch_step = -1

    def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
        assert self.model is not None
        if torch.is_grad_enabled():  # a training micro-batch, not ValidationHook's evaluation
            if self.micro_batch_step != self.step:
                self.micro_batch_step, self.micro_batch = self.step, 0
            self.micro_batch += 1
        out = self.model(input["x"]).float()
        loss = nn.functional.mse_loss(out, input["y"])
        return loss, {"error": (out - input["y"]).abs().mean().detach()}

    def where(self) -> tuple[int, Part]:
        """(step, part): ``before`` in STEP, the micro-batch in ACCUMULATE (from its forward to the
        next one's; 0 while the step's first batch is drawn), else the state."""
        state = self.state
        if state == "STEP":
            return self.step, "before"
        if state == "ACCUMULATE":
            return self.step, self.micro_batch if self.micro_batch_step == self.step else 0
        return self.step, state


class CountSteps(BaseHook):
    """First in the hook list: opens the count as step ``first`` begins, closes it as ``last + 1``
    does, so every hook's work of the counted steps is inside."""

    def __init__(self, reads: HostReads, first: int, last: int) -> None:
        self.reads, self.first, self.last = reads, first, last

    def on_before_step(self, trainer: BaseTrainer) -> None:
        if trainer.step == self.first:
            self.reads.start()
        elif trainer.step == self.last + 1:
            self.reads.stop()

    def on_after_train(self, trainer: BaseTrainer) -> None:
        self.reads.stop()


def count(
    tmp_path: Path, hooks: Sequence[BaseHook] = (), trainer_class: type[SyncTrainer] = SyncTrainer, **kwargs: Any
) -> dict[tuple[int, Part], list[Read]]:
    """Train FIRST..LAST + 1 steps and return the counted reads by (step, part)."""
    trainer: SyncTrainer | None = None
    reads = HostReads(where=lambda: trainer.where() if trainer is not None else None)
    trainer = trainer_class(
        hooks=[CountSteps(reads, FIRST, LAST), *hooks], max_steps=LAST + 1, workspace=tmp_path, **kwargs
    )
    with reads:
        trainer.train()
    assert not any(name in vars(torch.Tensor) for name in (*READS, "to")), "torch.Tensor left patched"
    out: dict[tuple[int, Part], list[Read]] = {}
    for read in reads.reads:
        out.setdefault(read.where, []).append(read)
    return out


def expect(
    at_end: Callable[[int], list[Key]],
    accumulation: int = 1,
    extra: Callable[[int], dict[Part, list[Key]]] = lambda step: {},
) -> dict[tuple[int, Part], list[Key]]:
    """The documented reads of each counted step: ``at_end(step)`` on its last micro-batch (the
    optimizer step and the hooks' step end), nothing on the others; ``extra`` adds parts."""
    out: dict[tuple[int, Part], list[Key]] = {}
    for step in range(FIRST, LAST + 1):
        out[(step, accumulation)] = list(at_end(step))
        for part, keys in extra(step).items():
            out.setdefault((step, part), []).extend(keys)
    return {where: keys for where, keys in out.items() if keys}


def assert_reads(counted: dict[tuple[int, Part], list[Read]], expected: dict[tuple[int, Part], list[Key]]) -> None:
    """Every counted step's reads are exactly the documented ones; else name each unexpected read
    by its frame, and each missing one."""
    problems: list[str] = []
    for where in sorted(set(counted) | set(expected), key=lambda w: (w[0], str(w[1]))):
        reads = counted.get(where, [])
        missing = Counter(expected.get(where, [])) - Counter(read.key for read in reads)
        unexpected = Counter(read.key for read in reads) - Counter(expected.get(where, []))
        step, part = where
        label = f"step {step}, " + (f"micro-batch {part}" if isinstance(part, int) else part)
        for read in reads:
            if unexpected[read.key] > 0:
                unexpected[read.key] -= 1
                problems.append(f"{label}: unexpected: {read}")
        problems.extend(f"{label}: missing: {blame} called {method}" for (blame, method) in missing.elements())
    if problems:  # raised, not asserted: pytest's rewriting would print the list a second time
        raise AssertionError("host reads differ from the documented count:\n  " + "\n  ".join(problems))


def per_step(counted: dict[tuple[int, Part], list[Read]]) -> dict[int, int]:
    steps: Counter[int] = Counter()
    for (step, _), reads in counted.items():
        steps[step] += len(reads)
    return dict(steps)


def interval(step: int, reads: list[Key]) -> list[Key]:
    return reads if step % INTERVAL == 0 else []


# ---------------------------------------------------------------- the step itself
def test_the_plain_loop_reads_once_per_step_the_finite_guard(tmp_path):
    counted = count(tmp_path)
    assert_reads(counted, expect(lambda step: [GUARD]))
    assert per_step(counted) == dict.fromkeys(range(FIRST, LAST + 1), 1)


def test_accumulation_reads_nothing_on_micro_batches_that_only_accumulate(tmp_path):
    counted = count(tmp_path, gradient_accumulation_steps=4)
    assert_reads(counted, expect(lambda step: [GUARD], accumulation=4))


def test_out_of_memory_retries_switched_on_add_no_read_to_a_routine_step(tmp_path):
    """``max_oom_retries``: the step's micro-batches are kept and run through ``MemoryFit``; the
    agreement among ranks runs only on a non-finite step."""
    assert_reads(
        count(tmp_path, max_oom_retries=3, gradient_accumulation_steps=2), expect(lambda step: [GUARD], accumulation=2)
    )


def test_grad_clip_reads_the_norm_it_computes_once(tmp_path):
    assert_reads(count(tmp_path, grad_clip=1.0), expect(lambda step: [GUARD_CLIP]))


@needs_cpu_fp16
def test_the_fp16_scaler_reads_its_inf_flags_once_at_the_guard(tmp_path):
    """``Stepper.apply`` steps the optimizer on the guard's answer rather than through
    ``GradScaler.step``, whose ``_maybe_opt_step`` would read the same flags again (torch's ``sum(v.item() ...)``)."""
    assert_reads(count(tmp_path, mixed_precision="fp16"), expect(lambda step: [GUARD_SCALER]))


@needs_cpu_fp16
def test_the_fp16_scaler_with_grad_clip(tmp_path):
    counted = count(tmp_path, mixed_precision="fp16", grad_clip=1.0, gradient_accumulation_steps=2)
    assert_reads(counted, expect(lambda step: [GUARD_CLIP], accumulation=2))


def test_an_epochs_first_batch_is_fingerprinted_for_the_data_ledger(tmp_path):
    """Five batches an epoch: steps 6 and 11 draw an epoch's first batch."""
    counted = count(tmp_path, batches=make_batches(5))
    epoch_start = {6, 11}
    assert_reads(
        counted,
        expect(
            lambda step: [GUARD], extra=lambda step: {0: FINGERPRINT * TENSOR_LEAVES} if step in epoch_start else {}
        ),
    )


# ---------------------------------------------------------------- the common hooks
HOOKS: dict[str, tuple[Callable[[], BaseHook], list[Key]]] = {
    # (the hook, its reads at its interval) with the trainer's records {"error": tensor}
    "ProgressHook": (lambda: ProgressHook(interval=INTERVAL), [STATS_CAST, STATS_COPY]),  # the loss
    "ProgressHook with records": (
        lambda: ProgressHook(interval=INTERVAL, with_records=True),
        [STATS_CAST, STATS_CAST, STATS_COPY],  # the loss and the record
    ),
    "LoggingHook": (lambda: LoggingHook(interval=INTERVAL), [STATS_CAST, STATS_CAST, STATS_COPY]),
    "StatsHook": (
        lambda: StatsHook(lambda trainer, stats: None, interval=INTERVAL),
        [STATS_CAST, STATS_CAST, STATS_COPY],
    ),
    "ValidationHook": (  # an evaluation: one read per value (the loss and the record), not per batch
        lambda: ValidationHook(INTERVAL, data_loader=make_batches(3)),
        [VALIDATION_VALUE, VALIDATION_VALUE],
    ),
}


@pytest.mark.parametrize("name", HOOKS)
def test_a_hook_reads_only_at_its_interval(tmp_path, name):
    make, at_interval = HOOKS[name]
    counted = count(tmp_path, hooks=[make()])
    assert_reads(counted, expect(lambda step: [GUARD, *interval(step, at_interval)]))


def test_a_stats_hook_with_grad_clip_copies_the_norms_at_its_interval(tmp_path):
    counted = count(tmp_path, hooks=[LoggingHook(interval=INTERVAL)], grad_clip=1.0)
    at_interval = [STATS_CAST] * 3 + [STATS_COPY]  # loss, grad_norm, the record
    assert_reads(counted, expect(lambda step: [GUARD_CLIP, *interval(step, at_interval)]))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync save", "async save"])
def test_the_checkpointing_hook_reads_nothing_between_saves(tmp_path, async_save):
    """A save (steps 8 and 12) reads no tensor through Python (nothing counted in CHECKPOINT); the
    batch after it (the next step's first) is fingerprinted for the data ledger."""
    counted = count(tmp_path, hooks=[CheckpointingHook(interval=INTERVAL, async_save=async_save)])
    after_save = {step for step in range(FIRST, LAST + 1) if (step - 1) % INTERVAL == 0 and step > FIRST}
    assert after_save == {9, 13}
    assert_reads(
        counted,
        expect(lambda step: [GUARD], extra=lambda step: {0: FINGERPRINT * TENSOR_LEAVES} if step in after_save else {}),
    )


def test_the_ema_hook_reads_nothing_after_its_first_update(tmp_path):
    """``AveragedModel.update_parameters`` reads its ``n_averaged`` twice (copy or average?): the
    hook calls it for its first update only (steps 1 here, before the window)."""
    assert_reads(count(tmp_path, hooks=[EmaHook(decay=0.9)]), expect(lambda step: [GUARD]))


def test_all_common_hooks_together(tmp_path):
    hooks = [
        ProgressHook(interval=INTERVAL),
        LoggingHook(interval=INTERVAL),
        CheckpointingHook(interval=2 * INTERVAL),
    ]
    counted = count(tmp_path, hooks=hooks, gradient_accumulation_steps=2)
    at_interval = [STATS_CAST, STATS_COPY, STATS_CAST, STATS_CAST, STATS_COPY]  # ProgressHook's, LoggingHook's

    def fingerprint_after_save(step: int) -> dict[Part, list[Key]]:
        return {0: FINGERPRINT * TENSOR_LEAVES} if step == 9 else {}

    assert_reads(counted, expect(lambda s: [GUARD, *interval(s, at_interval)], 2, fingerprint_after_save))


# ---------------------------------------------------------------- the counter itself
class Planted(BaseHook):
    """A hook that reads the step's loss on the host every step, in the way ``kind`` names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def on_after_step(self, trainer: BaseTrainer) -> None:
        loss = trainer.step_info.loss[0]
        match self.kind:
            case "item":
                loss.item()
            case "bool":
                bool(loss)
            case "if":
                if loss:
                    pass
            case "tolist":
                loss.tolist()
            case "cpu":
                loss.cpu()
            case "numpy":
                loss.numpy()
            case "float":
                float(loss)
            case "isfinite":
                math.isfinite(loss)
            case "int":
                int(loss)
            case "index":
                [0, 1][(loss > 1e9).long()]
            case "complex":
                complex(loss)
            case "format":
                f"{loss:.4f}"
            case "to cpu":
                loss.to("cpu")
            case "to device=cpu":
                loss.to(device=torch.device("cpu"))
            case _:
                raise ValueError(self.kind)


#: Each counted way to read a value: the method the counter names, and torch's frame between.
READ_KINDS: dict[str, tuple[str, str]] = {
    "item": ("Tensor.item", ""),
    "bool": ("Tensor.__bool__", ""),
    "if": ("Tensor.__bool__", ""),
    "tolist": ("Tensor.tolist", ""),
    "cpu": ("Tensor.cpu", ""),
    "numpy": ("Tensor.numpy", ""),
    "float": ("Tensor.__float__", ""),
    "isfinite": ("Tensor.__float__", ""),
    "int": ("Tensor.__int__", ""),
    "index": ("Tensor.__index__", ""),
    "complex": ("Tensor.__complex__", ""),
    "format": ("Tensor.item", " -> torch/_tensor.py:Tensor.__format__"),
    "to cpu": ("Tensor.to", ""),
    "to device=cpu": ("Tensor.to", ""),
}


@pytest.mark.parametrize("kind", READ_KINDS)
def test_a_planted_hook_that_reads_every_step_is_named(tmp_path, kind):
    method, via = READ_KINDS[kind]
    counted = count(tmp_path, hooks=[Planted(kind)])
    with pytest.raises(AssertionError) as failed:
        assert_reads(counted, expect(lambda step: [GUARD]))
    named = f"unexpected: tests/test_host_syncs.py:Planted.on_after_step{via} called {method} (line "
    assert str(failed.value).count(named) == LAST - FIRST + 1, str(failed.value)
    assert_reads(counted, expect(lambda step: [GUARD, ("tests/test_host_syncs.py:Planted.on_after_step", method)]))


def reading_hook(method: str) -> BaseHook:
    """A hook whose ``method`` (and nothing else) reads the model's bias on the host."""

    def read(self: BaseHook, trainer: BaseTrainer, *rest: Any) -> bool:
        bool(trainer.unwrapped_model.bias.sum() == 0.0)
        return False  # wants_stop, wants_checkpoint: no

    return type(f"Reads{method}", (BaseHook,), {method: read})()  # type: ignore[no-any-return]


#: Each hook method a routine step calls, and where its read lands.
STEP_METHODS = {
    "on_before_step": "before",
    "on_before_optimizer_step": 1,
    "on_evaluate": 1,
    "on_step_info": 1,
    "wants_stop": 1,
    "wants_checkpoint": 1,
    "on_after_step": 1,
}


@pytest.mark.parametrize("method", STEP_METHODS)
def test_a_read_in_any_hook_method_of_a_counted_step_is_counted(tmp_path, method):
    """The window holds every hook's work of each counted step, whatever the hook's place."""
    counted = count(tmp_path, hooks=[reading_hook(method)])
    planted = ("tests/test_host_syncs.py:reading_hook.<locals>.read", "Tensor.__bool__")
    assert_reads(counted, expect(lambda step: [GUARD], extra=lambda step: {STEP_METHODS[method]: [planted]}))


class ReadingForward(SyncTrainer):
    """A forward that reads its loss on the host, as many scripts do for a progress bar."""

    def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
        loss, records = super().forward(input)
        assert loss is not None
        self.losses.append(loss.item())
        return loss, records


def test_a_read_in_forward_is_counted_on_each_micro_batch(tmp_path):
    counted = count(tmp_path, trainer_class=ReadingForward, gradient_accumulation_steps=3)
    forward = ("tests/test_host_syncs.py:ReadingForward.forward", "Tensor.item")
    assert_reads(counted, expect(lambda step: [GUARD], 3, lambda step: {1: [forward], 2: [forward], 3: [forward]}))


def test_the_message_lists_each_unexpected_and_missing_read(tmp_path):
    counted = count(tmp_path, hooks=[Planted("item")])
    with pytest.raises(AssertionError) as failed:
        assert_reads(counted, expect(lambda step: [GUARD_CLIP]))
    lines = [re.sub(r" \(line \d+\)$", "", line.strip()) for line in str(failed.value).splitlines()]
    assert lines[0] == "host reads differ from the documented count:"
    assert len(lines) == 1 + 3 * (LAST - FIRST + 1)
    assert lines[1:4] == [
        "step 6, micro-batch 1: unexpected: src/trainfsm/finite.py:FiniteCheck.__call__ called Tensor.item",
        "step 6, micro-batch 1: unexpected: tests/test_host_syncs.py:Planted.on_after_step called Tensor.item",
        "step 6, micro-batch 1: missing: src/trainfsm/step.py:Stepper.check_and_clip called Tensor.__bool__",
    ]


def test_reads_outside_the_window_are_not_counted_and_torch_is_restored(tmp_path):
    """The planted hook reads at every step of the run; only FIRST..LAST count."""
    counted = count(tmp_path, hooks=[Planted("item")])
    planted = {step for (step, _), reads in counted.items() for read in reads if "Planted" in read.blame}
    assert sorted(planted) == list(range(FIRST, LAST + 1))
    assert torch.Tensor.item is torch._C.TensorBase.item and torch.Tensor.__bool__ is torch._C.TensorBase.__bool__


def test_a_read_on_another_thread_is_counted_with_its_thread():
    reads = HostReads()
    with reads:
        reads.start()
        worker = threading.Thread(target=lambda: torch.ones(1).item(), name="writer")
        worker.start()
        worker.join()
    assert [(r.method, r.thread) for r in reads.reads] == [("Tensor.item", "writer")]
    assert "[thread writer]" in str(reads.reads[0])


def test_torchs_own_same_device_moves_are_not_counted_but_ours_are():
    """``GradScaler`` and ``clip_grad_norm_`` call ``.to(device)`` to gather onto one device: a
    no-op on one GPU, so not counted; a ``.to`` to the CPU in our code is."""
    params = [torch.ones(3, requires_grad=True)]
    params[0].grad = torch.ones(3)
    reads = HostReads()
    with reads:
        reads.start()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        torch.zeros(1).to("cpu")
        torch.zeros(1).to(torch.float64)  # no device: not a move
    assert [r.method for r in reads.reads] == ["Tensor.to"]
