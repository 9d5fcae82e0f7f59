"""Edges of the data position across world sizes (found by the review of issue 49): each test is a defect
the review found (it failed before the fix), now the behaviour that holds.

Most run a ``DataCursor`` per rank in this process, as RESTORE does after ``data_order.other_size``
(the harness of ``tests/test_data_order.py``): old ranks draw up to a save, new ranks continue
from every old rank's saved position, and the indices each trained are counted.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from tests.cli_helpers import SignalAtStep
from tests.helpers import TinyTrainer, make_batches, trail_events
from tests.test_data_order import Log
from tests.test_data_resume import Samples, Trainer, _shuffled_partial_batches, stateful_dataloader, train
from trainfsm import CheckpointingHook, data_order, rng
from trainfsm.data_cursor import EXHAUSTED, EXIT_DRAW_SECONDS, DataCursor


def epoch_order(n: int, epoch: int = 0, seed: int = 0) -> list[int]:
    """``DistributedSampler(shuffle=True, seed=seed)``'s order of ``epoch``, at any world size."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def run_ranks(
    make: Any, n: int, world: int, batch: int, global_batch: int, old: list[dict[str, Any]] | None, stop: int | None
) -> tuple[Counter[int], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every rank of ``world`` on the loader ``make(world, rank)`` builds: resumed from ``old``
    (every old rank's saved position) if given, drawing ``stop`` micro-batches (None: to the end of
    epoch 0). Returns the indices trained, each rank's saved position, and the ``data_resumed`` fields."""
    trained: Counter[int] = Counter()
    saves, resumes = [], []
    for rank in range(world):
        loader = make(world, rank)
        accumulation = data_order.accumulation_for(global_batch, batch, world)
        layout = data_order.layout_of(loader, rank, world, accumulation, global_batch)
        cursor = DataCursor()
        cursor.attach(loader, 1, Log(), layout)
        if old is not None:
            cursor.resume_later("auto", {"resize": old, "reshard": "exact", "rng_how": "seeded 1"}, rng.seeded(1))
        resumed = cursor.start()
        if resumed is not None:
            resumes.append({**resumed.as_event(), "layout": layout.order})
        drawn = 0
        while stop is None or drawn < stop:
            found = cursor.next()
            if found is EXHAUSTED:
                break
            trained.update(torch.as_tensor(found).reshape(-1).tolist())
            drawn += 1
        saves.append(cursor.state())
        cursor.close()
    return trained, saves, resumes


def twice_and_never(trained: Counter[int], n: int, global_batch: int) -> tuple[list[int], list[int]]:
    expected = set(epoch_order(n)[: (n // global_batch) * global_batch])
    return sorted(i for i, count in trained.items() if count > 1), sorted(expected - set(trained))


# ----------------------------------------------------------------------------------------------
# 1. A user's batch_sampler (or a DistributedSampler subclass) whose batches are not consecutive
#    pieces of order[r::W] is taken as a "distributed" layout, and a resume on another size says
#    exact=True while it trains samples twice and never.


class LengthBucketed(BatchSampler):
    """A bucketing batch sampler, as speech and NLP loaders use: the indices of every 4 batches
    are sorted by length (here: the index itself) before being cut into batches, so that a batch
    holds samples of similar length. It keeps BatchSampler's ``sampler`` and ``batch_size``."""

    def __iter__(self) -> Iterator[list[int]]:
        window: list[int] = []
        for index in self.sampler:
            window.append(index)
            if len(window) == 4 * self.batch_size:
                yield from self._cut(sorted(window))
                window = []
        yield from self._cut(sorted(window))

    def _cut(self, indices: list[int]) -> Iterator[list[int]]:
        for start in range(0, len(indices), self.batch_size):
            batch = indices[start : start + self.batch_size]
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch


class Contiguous(DistributedSampler):  # type: ignore[type-arg]
    """A DistributedSampler that gives each rank a contiguous block of the epoch's order
    (``order[r*M:(r+1)*M]``), as several evaluation and sharding samplers do."""

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(len(self.dataset), self.epoch, self.seed)  # type: ignore[arg-type]
        order += order[: self.total_size - len(order)]
        return iter(order[self.rank * self.num_samples : (self.rank + 1) * self.num_samples])


def bucketed(world: int, rank: int) -> DataLoader[Any]:
    sampler: DistributedSampler[int] = DistributedSampler(range(96), num_replicas=world, rank=rank, seed=0)  # type: ignore[arg-type]
    return DataLoader(range(96), batch_sampler=LengthBucketed(sampler, 2, drop_last=False))  # type: ignore[arg-type]


def contiguous(world: int, rank: int) -> DataLoader[Any]:
    sampler = Contiguous(range(96), num_replicas=world, rank=rank, shuffle=True, seed=0)  # type: ignore[arg-type]
    return DataLoader(range(96), batch_size=2, sampler=sampler)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [bucketed, contiguous], ids=["bucketing batch_sampler", "DistributedSampler subclass"])
def test_a_loader_whose_order_is_not_order_r_w_is_not_continued_as_exact(make: Any) -> None:
    """4 ranks draw 2 micro-batches of 2 (16 samples of 96, G=16), then 2 ranks continue to the end
    of the epoch: either the resume says it is not exact (or refuses), or each sample is trained once."""
    before, saves, _ = run_ranks(make, 96, 4, 2, 16, None, stop=2)
    try:
        after, _, resumes = run_ranks(make, 96, 2, 2, 16, saves, stop=None)
    except data_order_error():
        return  # refused before training: what the issue asks for an order the trainer cannot see into
    if not all(event["exact"] for event in resumes):
        return  # said so (data_reshard="approximate" would be needed)
    twice, never = twice_and_never(before + after, 96, 16)
    assert (twice, never) == ([], []), f"exact=True, yet {len(twice)} samples trained twice, {len(never)} never"


def data_order_error() -> type[Exception]:
    from trainfsm.data_cursor import DataReshardError

    return DataReshardError


# ----------------------------------------------------------------------------------------------
# 2. data_resumed.why on another world size says "asked for (data_resume)" when data_resume was
#    "auto": the continuation resolves the mode, then data_state.resume chooses it again.


def plain(world: int, rank: int) -> DataLoader[Any]:
    sampler: DistributedSampler[int] = DistributedSampler(range(96), num_replicas=world, rank=rank, seed=0)  # type: ignore[arg-type]
    return DataLoader(range(96), batch_size=2, sampler=sampler)  # type: ignore[arg-type]


def test_the_why_of_a_resume_on_another_size_is_not_asked_for_when_auto_chose() -> None:
    _, saves, _ = run_ranks(plain, 96, 4, 2, 16, None, stop=2)
    _, _, resumes = run_ranks(plain, 96, 2, 2, 16, saves, stop=1)
    assert resumes[0]["mode"] == "sampler" and resumes[0]["exact"] is True
    assert resumes[0]["why"] != "asked for (data_resume)"


# ----------------------------------------------------------------------------------------------
# 3. A global batch larger than the dataset: the epoch limit is 0 micro-batches, epoch 0 trains
#    nothing, and every later epoch trains the sampler's whole epoch (the new-epoch branch of
#    DataCursor.next does not look at the limit). No error says so.


def test_a_global_batch_larger_than_the_dataset_is_refused_or_trains_the_same_in_every_epoch() -> None:
    sampler: DistributedSampler[int] = DistributedSampler(range(10), num_replicas=1, rank=0, seed=0)  # type: ignore[arg-type]
    loader: DataLoader[Any] = DataLoader(range(10), batch_size=2, sampler=sampler)  # type: ignore[arg-type]
    try:
        accumulation = data_order.accumulation_for(16, 2, 1)
        layout = data_order.layout_of(loader, 0, 1, accumulation, 16)
    except ValueError:
        return  # refused, naming it: fine
    cursor = DataCursor()
    cursor.attach(loader, 3, Log(), layout)
    cursor.start()
    per_epoch: Counter[int] = Counter()
    while (batch := cursor.next()) is not EXHAUSTED:
        per_epoch[cursor.epoch] += len(batch)
    assert per_epoch[0] == per_epoch[1] == per_epoch[2] == layout.epoch_samples, dict(per_epoch)


# ----------------------------------------------------------------------------------------------
# 4. set_epoch is forwarded to the dataset in the main process only: with persistent_workers the
#    workers' copies never hear of it, and an iterable dataset repeats epoch 0's order every epoch.


class EpochStream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(epoch_order(self.n, self.epoch))


def test_persistent_workers_that_never_hear_of_the_datasets_epoch_are_warned_of() -> None:
    """The dataset's ``set_epoch`` runs in the training process; persistent workers keep their copy
    (epoch 0's order every epoch): that cannot be fixed from outside the dataset, so it is said."""
    from trainfsm import EpochWarning

    with pytest.warns(EpochWarning, match="persistent_workers=False"):
        DataCursor().attach(DataLoader(EpochStream(8), batch_size=4, num_workers=1, persistent_workers=True), 2, Log())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataCursor().attach(DataLoader(EpochStream(8), batch_size=4, num_workers=1), 2, Log())  # made anew each epoch


# ----------------------------------------------------------------------------------------------
# 5. An exiting save (preemption, deadline, the last step) now draws the next batch before EXIT:
#    the exit, and the trainer's `scontrol requeue` after it, wait for the data loader, a time
#    the deadline's plan (EXIT_SECONDS) does not count.


class StallsAfter:
    """Batches; each one after the first ``fast`` takes ``seconds`` to arrive (a slow remote read,
    a stream that stalls)."""

    def __init__(self, fast: int, seconds: float) -> None:
        self.batches, self.fast, self.seconds = make_batches(8), fast, seconds

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i, batch in enumerate(self.batches):
            if i >= self.fast:
                time.sleep(self.seconds)
            yield batch


@pytest.mark.slow  # ~3 s (one stalled draw)
def test_a_preempted_run_waits_for_the_data_loader_at_most_the_exit_draws_budget(tmp_path: Path) -> None:
    """The batch after the save is drawn on a thread and waited for ``EXIT_DRAW_SECONDS`` (1 s) at
    most: a loader that stalls longer leaves that save without a fingerprint, and the run leaves."""
    loader = StallsAfter(fast=3, seconds=2.0)  # steps 1-3 are fast; the 4th batch takes 2 s
    trainer = TinyTrainer(
        batches=loader, max_steps=8, workspace=tmp_path, hooks=[CheckpointingHook(interval=100), SignalAtStep(3)]
    )
    trainer.set_exit_signals([signal.SIGUSR1])
    with pytest.raises(SystemExit) as info:
        trainer.train()
    assert info.value.code == 138
    events = trail_events(tmp_path)
    [saved] = [e for e in events if e["event"] == "checkpoint_saved"]
    [left] = [e for e in events if e["event"] == "exit"]
    assert left["ts"] - saved["ts"] < EXIT_DRAW_SECONDS + 0.5, (
        f"{left['ts'] - saved['ts']:.1f} s from the save to the exit"
    )
    [unchecked] = [e for e in events if e["event"] == "batch_fingerprint"]
    assert (unchecked["after"], unchecked["from_step"], unchecked["fingerprint"]) == ("save", 3, None)


# ----------------------------------------------------------------------------------------------
# 6. The trail contract: after="save" at EVERY save that can be resumed from. An exiting save at
#    an epoch's end records none (fingerprint_at_exit stops at StopIteration / the limit).


def test_an_exiting_save_at_an_epochs_end_records_the_batch_a_resume_draws_first(tmp_path: Path) -> None:
    train(tmp_path, lambda: DataLoader(Samples(8), batch_size=4, shuffle=True), 2)  # 2 steps: epoch 0's end
    resumed = train(tmp_path, lambda: DataLoader(Samples(8), batch_size=4, shuffle=True), 3)
    assert len(resumed.seen) == 1
    fingerprints = [(e["after"], e["from_step"]) for e in trail_events(tmp_path) if e["event"] == "batch_fingerprint"]
    assert ("save", 2) in fingerprints, fingerprints  # ("resume", 2) is there, with nothing to compare it to


# ----------------------------------------------------------------------------------------------
# 7. data_resumed says exact=True when the position was not restored at all (mode fell back to
#    "none": a fresh iterator, the epoch started again).


def test_a_resume_that_starts_the_epoch_again_is_not_called_exact(tmp_path: Path) -> None:
    train(tmp_path, _shuffled_partial_batches, 3)
    loader_type = stateful_dataloader()
    train(tmp_path, lambda: loader_type(Samples(30), batch_size=4, shuffle=True), 5)
    [record] = [e for e in trail_events(tmp_path) if e["event"] == "data_resumed"]
    assert record["mode"] == "none" and record["batches"] == 0
    assert record["exact"] is not True


# ----------------------------------------------------------------------------------------------
# 8. The guide: "each sample of each epoch trained once" (with global_batch_size over a
#    DistributedSampler). A non-finite retry draws fresh micro-batches and the retried ones are
#    never trained in that epoch (a loss=None skip likewise), at any world size.


class NaNOnce(Trainer):
    def __init__(self, *args: Any, nan_at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nan_at, self.calls = nan_at, 0

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        self.calls += 1
        loss, records = super().forward(batch)
        return (loss * math.nan if self.calls == self.nan_at else loss), records


def test_a_non_finite_retry_draws_fresh_positions_and_the_retried_ones_are_not_trained(tmp_path: Path) -> None:
    """What the data-resume guide says: each position of the epoch's order is drawn once; the
    micro-batches of a retried step are not trained (the data ledger names them)."""
    sampler: DistributedSampler[Any] = DistributedSampler(Samples(16), num_replicas=1, rank=0, shuffle=True, seed=0)
    torch.manual_seed(1)
    trainer = NaNOnce(
        lambda: DataLoader(sampler.dataset, batch_size=2, sampler=sampler),
        CheckpointingHook(interval=10**9),
        nan_at=2,  # step 1's second micro-batch: the step is retried on two fresh micro-batches
        max_steps=3,
        global_batch_size=4,
        max_non_finite_grad_retries=1,
        workspace=tmp_path,
    )
    trainer.train()
    drawn = [index for batch in trainer.seen for index in batch]
    assert drawn == epoch_order(16)[: len(drawn)]  # each position once, in order
    assert len(drawn) == (3 + 1) * 4  # three steps and the retried one


# ----------------------------------------------------------------------------------------------
# 9. A StatefulDataLoader resumed on another size replays (loads) every skipped sample: the cost of
#    RESTORE grows with the position, where the same size loads nothing and a DataLoader skips at
#    its sampler.


class Counted(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n, self.loads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loads += 1
        return index


def test_a_stateful_loader_resumed_on_another_size_replays_its_share_and_says_so() -> None:
    """The documented cost: its saved state is another rank's, so this rank's share is replayed."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    datasets: list[Counted] = []

    def stateful(world: int, rank: int) -> Any:
        datasets.append(Counted(96))
        sampler: DistributedSampler[int] = DistributedSampler(datasets[-1], num_replicas=world, rank=rank, seed=0)
        return StatefulDataLoader(datasets[-1], batch_size=2, sampler=sampler)

    _, saves, _ = run_ranks(stateful, 96, 4, 2, 16, None, stop=8)  # 64 samples into the epoch
    datasets.clear()
    _, _, resumes = run_ranks(stateful, 96, 2, 2, 16, saves, stop=0)
    assert resumes[0]["exact"] is True and (resumes[0]["mode"], resumes[0]["batches"]) == ("skip", 16)
    assert "another world size (4 -> 2)" in resumes[0]["why"] and "replayed" in resumes[0]["why"]
    assert [d.loads for d in datasets] == [32, 32]


# ----------------------------------------------------------------------------------------------
# 10. A job requeued onto a world size that the global batch does not fit (SLURM --nodes=2-4 gave
#     it 5 ranks): the error suggests "a per-rank batch size that divides 24 / 5" (4.8) and does
#     not name the world sizes the run can go on with.


def test_the_error_for_a_world_size_the_global_batch_does_not_fit_names_the_sizes_that_do() -> None:
    with pytest.raises(ValueError) as info:
        data_order.accumulation_for(24, 2, 5)
    message = str(info.value)
    assert "24 / 5" not in message, message
    assert all(re.search(rf"\b{size}\b", message) for size in (3, 4, 6, 12)), message  # 1, 2, 3, 4, 6, 12 fit


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


# Review of issue 49 (session 14): a resume whose global batch changed at the same world size.
def test_a_resume_past_the_epoch_end_of_a_smaller_global_batch_ends_the_epoch_there() -> None:
    """100 samples, batches of 2 on one rank: with ``global_batch_size=8`` an epoch ends at 96
    positions; 44 micro-batches (88 positions) are drawn and saved. Resumed with
    ``global_batch_size=40`` (accumulation 20), the epoch ends at 80: the resume is past it, so
    the epoch ends at once, not after drawing positions 88-99 (with the padding a run of 40 never
    trains): the limit compared with ``!=`` let it draw on to the sampler's end."""

    def cursor(global_batch: int) -> DataCursor:
        dataset = list(range(100))
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler)
        accumulation = data_order.accumulation_for(global_batch, 2, 1)
        made = DataCursor()
        made.attach(loader, 1, Log(), data_order.layout_of(loader, 0, 1, accumulation, global_batch))
        return made

    first = cursor(8)
    first.start()
    drawn = [first.next() for _ in range(44)]
    saved = first.state()
    first.close()
    assert sum(len(batch) for batch in drawn) == 88
    second = cursor(40)
    assert second.limit == 40
    second.resume_later("auto", saved, None)
    assert second.start() is not None
    assert second.next() is EXHAUSTED  # max_epochs=1: epoch 0 ended at its new end
    second.close()
