"""Out of memory as a transition (``BaseTrainer(max_oom_retries=N)``, ``trainfsm.oom``): a step whose
forward or backward raises ``torch.OutOfMemoryError`` runs again from its first micro-batch, on the
micro-batches it had drawn, each split in two; the split stays. The fault is injected the way a
kill is: ``tests/oom_trainer.FitsUpTo`` raises the real error above a number of rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import audit_problems, events, run_worker
from tests.helpers import read_events, transitions_of
from tests.oom_trainer import FitsUpTo, batches, model, quartered
from trainfsm import CheckpointingHook
from trainfsm.oom import BatchSplitError
from trainfsm.tools import audit
from trainfsm.tools.ledger import ONCE

WORKER = Path(__file__).resolve().parent / "distributed" / "oom_worker.py"


def parameters(trainer: FitsUpTo) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]  # type: ignore[union-attr]


def ooms(workspace: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(workspace) if e["event"] == "oom"]


def test_a_run_that_fits_16_rows_given_64_trains_to_the_end_as_a_run_given_16_and_four_times_the_accumulation(
    tmp_path: Path,
) -> None:
    data = batches(7)
    split = FitsUpTo(data, limit=16, max_steps=10, max_oom_retries=3, workspace=tmp_path / "split")
    split.train()
    reference = FitsUpTo(quartered(data), max_steps=10, gradient_accumulation_steps=4, workspace=tmp_path / "ref")
    reference.train()
    assert split.step == 10 and split.exit_reason == "completed"
    for mine, theirs in zip(parameters(split), parameters(reference), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert set(split.rows_seen) == {16} and len(split.rows_seen) == 10 * 4
    assert [
        (e["step"], e["micro"], e["phase"], e["rows"], e["pieces"], e["piece_rows"], e["replays"])
        for e in ooms(tmp_path / "split")
    ] == [(1, 0, "forward", 64, 2, 32, 1), (1, 0, "forward", 32, 4, 16, 1)]


def test_the_oom_transitions_go_from_accumulate_to_retry_and_back_to_the_same_step(tmp_path: Path) -> None:
    FitsUpTo(batches(3), limit=32, max_steps=2, max_oom_retries=1, workspace=tmp_path).train()
    rows = [(t, s, d) for t, s, d in transitions_of(read_events(tmp_path)) if s != "BUILD" and d != "EXIT"]
    assert rows[:5] == [
        ("restored", "RESTORE", "STEP"),
        ("micro", "STEP", "ACCUMULATE"),
        ("oom", "ACCUMULATE", "RETRY"),
        ("retry", "RETRY", "ACCUMULATE"),
        ("stepped", "ACCUMULATE", "STEP"),
    ]


def test_with_accumulation_the_retry_runs_the_micro_batches_already_drawn_and_the_ledger_keeps_each_once(
    tmp_path: Path,
) -> None:
    """Micro-batch 1 of step 1 fails: the retry runs micro-batches 0 and 1 again (kept, not drawn),
    so the step trains the samples it drew, and the next step draws on from micro-batch 2."""
    data = [*batches(6), {"x": torch.zeros(16, 8), "y": torch.zeros(16, 1)}]  # an epoch's short last batch fits
    data[1] = {key: torch.cat([value, value]) for key, value in data[1].items()}  # 128 rows: too big
    saves = CheckpointingHook(interval=2)  # each save's data position must be what the trail counts
    split = FitsUpTo(
        data, limit=64, max_steps=6, gradient_accumulation_steps=2, max_oom_retries=1, workspace=tmp_path, hooks=[saves]
    )
    split.train()
    [made] = ooms(tmp_path)
    resumed = FitsUpTo(
        data, limit=64, max_steps=8, gradient_accumulation_steps=2, max_oom_retries=1, workspace=tmp_path,
        hooks=[CheckpointingHook(interval=2)],
    )  # fmt: skip
    resumed.train()  # from checkpoint 6: the split is not saved, so it is found again when needed
    assert (made["step"], made["micro"], made["rows"], made["replays"]) == (1, 1, 128, 2)
    assert split.rows_seen[:4] == [64, 32, 32, 64]  # micro-batch 0 before; 0 and 1 again, halved
    report = audit.audit([tmp_path])
    assert report.problems == [] and report.run_problems == []
    assert report.ledger[0].endswith(ONCE), report.ledger
    assert "out of memory: step 1 (forward): 2 pieces" in audit.render(report)


def test_an_out_of_memory_error_in_backward_is_retried_like_one_in_forward(tmp_path: Path) -> None:
    data = batches(4)
    split = FitsUpTo(data, limit=32, in_backward=True, max_steps=4, max_oom_retries=1, workspace=tmp_path / "a")
    split.train()
    reference = FitsUpTo(
        [{k: v[i * 32 : (i + 1) * 32] for k, v in b.items()} for b in data for i in range(2)],
        max_steps=4,
        gradient_accumulation_steps=2,
    )
    reference.train()
    assert [(e["phase"], e["pieces"]) for e in ooms(tmp_path / "a")] == [("backward", 2)]
    for mine, theirs in zip(parameters(split), parameters(reference), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_by_default_an_out_of_memory_error_ends_the_run_and_says_how_to_retry(tmp_path: Path) -> None:
    run = FitsUpTo(batches(2), limit=16, max_steps=2, workspace=tmp_path)
    with pytest.raises(torch.OutOfMemoryError) as info:
        run.train()
    assert "BaseTrainer(max_oom_retries=N) would run the step again in smaller micro-batches" in info.value.__notes__[0]
    assert run.exit_reason == "failed" and ooms(tmp_path) == []


def test_retries_used_up_end_the_run_naming_the_limit_and_the_pieces(tmp_path: Path) -> None:
    run = FitsUpTo(batches(2), limit=16, max_steps=2, max_oom_retries=1, workspace=tmp_path)
    with pytest.raises(torch.OutOfMemoryError, match=r"pieces of 32 samples, after 1 split\(s\) \(max_oom_retries=1\)"):
        run.train()
    assert [e["pieces"] for e in ooms(tmp_path)] == [2]


def test_a_run_that_cannot_fit_one_sample_ends_with_that_message_and_trace_shows_its_oom_transitions(
    tmp_path: Path,
) -> None:
    run = FitsUpTo(batches(2, rows=4), limit=0, max_steps=2, max_oom_retries=5, workspace=tmp_path)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory with micro-batches of 1 sample"):
        run.train()
    assert [(e["rows"], e["pieces"]) for e in ooms(tmp_path)] == [(4, 2), (2, 4)]
    done = subprocess.run(
        [sys.executable, "-m", "trainfsm", "trace", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert "out of memory with micro-batches of 1 sample" in done.stdout
    assert done.stdout.count("RETRY transition trigger=oom source=ACCUMULATE dest=RETRY") == 3, done.stdout


def test_a_batch_that_cannot_be_split_is_named_with_the_step(tmp_path: Path) -> None:
    data = [{"x": torch.randn(64, 8), "y": torch.randn(64, 1), "mask": torch.ones(8)}] * 2
    run = FitsUpTo(data, limit=16, max_steps=2, max_oom_retries=2, workspace=tmp_path)
    with pytest.raises(
        BatchSplitError, match=r"Step 1: out of memory .* do not share a first dimension \(first dimensions: 8, 64\)"
    ):
        run.train()


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), ("2", TypeError), (1.5, TypeError), (True, TypeError)])
def test_max_oom_retries_takes_a_whole_number_from_zero(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"max_oom_retries must be an int >= 0 or None"):
        FitsUpTo([], max_steps=1, max_oom_retries=value)


def test_max_oom_retries_none_is_off_as_zero() -> None:
    assert FitsUpTo([], max_steps=1, max_oom_retries=None).max_oom_retries == 0


@pytest.mark.distributed
@pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux")
def test_two_ddp_ranks_where_only_rank_1_runs_out_split_together_and_keep_each_batch_once(tmp_path: Path) -> None:
    """Rank 0 never runs out; rank 1 does above 16 rows. Rank 1 goes on through the step with
    one-sample forwards and a NaN loss so that DDP's all-reduce pairs; at the non-finite step's end
    one all-reduce tells both, and both split at step 1 (twice), ending where a run given batches of
    16 and accumulation 4 ends."""
    outcome = run_worker("oom", tmp_path, 180, world=2, worker=WORKER)
    assert set(outcome.codes.values()) == {0} and not outcome.hung, outcome.describe()
    made = {rank: [e for e in events(tmp_path / "split", rank) if e["event"] == "oom"] for rank in (0, 1)}
    assert [(e["step"], e["pieces"], e["ranks"]) for e in made[0]] == [(1, 2, [1]), (1, 4, [1])]
    assert [(e["step"], e["pieces"], e["ranks"]) for e in made[1]] == [(1, 2, [1]), (1, 4, [1])]
    assert [e["micro"] for e in made[0]] == [None, None] and [e["micro"] for e in made[1]] == [0, 0]
    for rank in (0, 1):
        result = torch.load(tmp_path / f"oom.rank{rank}.pt")
        for mine, theirs in zip(result["split"], result["reference"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
        # One gradient all-reduce per step, split or not (the pieces accumulate under no_sync), and
        # one for each of step 1's two tries that ran out.
        assert result["all_reduces"] == {"split": 5 + 2, "reference": 5}
    assert audit_problems(tmp_path / "split") == []
    report = audit.audit([tmp_path / "split"])
    assert report.run_problems == [] and all(line.endswith(ONCE) for line in report.ledger), report.ledger


class FirstHalfNone(FitsUpTo):
    """Returns loss=None for the first half of batch 0 once it is split (rows 0-31 of 64)."""

    def forward(self, batch: Any) -> Any:
        first = self.data[0]["x"]
        if batch["x"].shape[0] == 32 and torch.equal(batch["x"], first[:32]):
            return None, {}
        return super().forward(batch)


def test_a_piece_that_returns_loss_none_trains_nothing_and_the_others_keep_their_share(tmp_path: Path) -> None:
    """The gradient and the reported loss are the other piece's at half the weight (its share of the
    rows), as in the unsplit micro-batch whose loss is the mean over all its rows."""
    data = batches(1)
    run = FirstHalfNone(data, limit=32, max_steps=1, max_oom_retries=1, workspace=tmp_path)
    run.train()
    net = model()
    x, y = data[0]["x"][32:], data[0]["y"][32:]
    loss = torch.nn.functional.mse_loss(net(x), y) * 0.5
    loss.backward()
    with torch.no_grad():
        expected = [p - 0.05 * p.grad for p in net.parameters()]
    for mine, theirs in zip(parameters(run), expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-7)
    torch.testing.assert_close(run.step_info["loss"][0], loss.detach(), rtol=0, atol=1e-7)


class ScratchOnCuda(FitsUpTo):
    """On CUDA, a forward that allocates ``per_row`` bytes of scratch per row: a real allocation
    failure of the caching allocator once the rows outgrow the memory the test leaves it."""

    per_row = 0

    def forward(self, batch: Any) -> Any:
        rows = batch["x"].shape[0]
        scratch = torch.empty(rows * self.per_row, dtype=torch.uint8, device=self.device)
        scratch.zero_()
        x, y = batch["x"].to(self.device), batch["y"].to(self.device)
        loss = torch.nn.functional.mse_loss(self.model(x), y)  # type: ignore[misc]
        del scratch
        self.rows_seen.append(rows)
        return loss, {}


@pytest.mark.cuda
def test_on_cuda_a_real_allocation_failure_splits_the_step_and_the_run_trains_as_one_given_smaller_batches(
    tmp_path: Path,
) -> None:
    """The allocator is capped at 2 GiB (``set_per_process_memory_fraction``); a forward of 16 rows
    takes two thirds of it, one of 32 or 64 more than all of it: the caching allocator's own
    ``torch.OutOfMemoryError``. The run splits twice at step 1 and ends where a run given micro-batches
    of 16 and four times the accumulation ends."""
    device = torch.device("cuda")
    cap = 2 * 1024**3
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory)
    try:
        ScratchOnCuda.per_row = cap // 24
        data = batches(5)
        split = ScratchOnCuda(data, max_steps=5, max_oom_retries=3, device=device, workspace=tmp_path / "split")
        split.train()
        ScratchOnCuda.per_row = 0
        reference = ScratchOnCuda(quartered(data), max_steps=5, gradient_accumulation_steps=4, device=device)
        reference.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    made = ooms(tmp_path / "split")
    assert [(e["step"], e["rows"], e["pieces"]) for e in made] == [(1, 64, 2), (1, 32, 4)]
    assert "out of memory" in made[0]["message"].lower()  # the allocator's message, not a planted one
    assert set(split.rows_seen) == {16}
    for mine, theirs in zip(parameters(split), parameters(reference), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
