"""The position arithmetic of ``trainfsm.data_order``: a run's global position in each epoch's
order, continued on another number of ranks (issue 49)."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from trainfsm import data_order, rng
from trainfsm.data_cursor import DataCursor, DataReshardError


def loader(n: int, world: int, rank: int, batch: int, drop_last: bool = False, seed: int = 0) -> DataLoader[Any]:
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    return DataLoader(range(n), batch_size=batch, sampler=sampler)  # type: ignore[arg-type]


def layout(n: int, world: int, rank: int, batch: int, global_batch: int | None, **kw: Any) -> data_order.Layout:
    accumulation = 1 if global_batch is None else global_batch // (world * batch)
    return data_order.layout_of(loader(n, world, rank, batch, **kw), rank, world, accumulation, global_batch)


STATE = rng.capture()  # a saved random state, as every checkpoint has


def saved(position: tuple[int, int], at: data_order.Layout) -> dict[str, Any]:
    """A rank's saved data position, as ``data_state.capture`` writes it."""
    epoch, batches = position
    return {"epoch": epoch, "batches": batches, "epoch_rng": STATE, "loader": None, "layout": at.as_event()}


def drawn(n: int, world: int, rank: int, batch: int, epoch: int, begin: int, end: int) -> list[int]:
    """The indices rank ``rank`` draws as micro-batches ``begin``..``end - 1`` of ``epoch``."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)[begin * batch : end * batch]


def test_a_distributed_sampler_loader_has_a_visible_order() -> None:
    found = layout(100, 4, 1, 2, 24)
    assert (found.order, found.world_size, found.rank, found.batch_size, found.length) == ("distributed", 4, 1, 2, 100)
    assert (found.accumulation, found.epoch_batches, found.epoch_samples) == (3, 12, 96)
    assert found.samples(6) == 48


def test_without_global_batch_size_the_epoch_is_the_samplers_own() -> None:
    padded = layout(100, 3, 0, 2, None)  # 34 indices per rank (2 repeated), 17 micro-batches
    assert (padded.epoch_batches, padded.epoch_samples) == (17, 102)
    assert layout(100, 3, 0, 2, None, drop_last=True).epoch_samples == 99


def test_a_loader_without_a_distributed_sampler_is_unknown_and_says_why() -> None:
    found = data_order.layout_of(DataLoader(range(10), batch_size=2), 0, 2, 1, None)
    assert found.order == "unknown" and "DistributedSampler" in (found.why or "")
    wrong = data_order.layout_of(loader(10, 2, 0, 2), 1, 2, 1, None)  # the sampler is rank 0's
    assert wrong.order == "unknown" and "rank 0 of 2" in (wrong.why or "")


def test_the_global_batch_that_world_size_and_batch_size_cannot_make_is_refused_by_name() -> None:
    assert data_order.accumulation_for(24, 2, 3) == 4
    with pytest.raises(ValueError, match=r"global_batch_size=24 is not a multiple of world_size 5 x .* batch_size 2"):
        data_order.accumulation_for(24, 2, 5)


def test_a_position_continues_at_another_size_on_each_rank_s_own_share() -> None:
    old = [saved((0, 6), layout(100, 4, r, 2, 24)) for r in range(4)]
    found = data_order.continue_at(old, layout(100, 2, 1, 2, 24))
    assert found.exact and found.global_position == {"epoch": 0, "samples": 48}
    assert (found.data["epoch"], found.data["batches"]) == (0, 12)


def test_a_position_the_new_size_does_not_divide_is_not_exact_and_says_so() -> None:
    old = [saved((0, 1), layout(96, 4, r, 2, None)) for r in range(4)]  # 8 samples: 3 ranks x 2 do not divide it
    found = data_order.continue_at(old, layout(96, 3, 0, 2, None))
    assert not found.exact and "not a multiple of world size 3 x batch size 2" in (found.reason or "")
    assert found.data["batches"] == 1  # rounded down: 6 of the 8 samples


def test_epochs_that_end_differently_at_the_two_sizes_are_not_exact() -> None:
    old = [saved((0, 2), layout(100, 4, r, 2, None)) for r in range(4)]  # 100 per epoch at 4 ranks, 102 at 3
    found = data_order.continue_at(old, layout(100, 2, 0, 2, None))
    assert found.exact  # 100 at 2 ranks too
    found = data_order.continue_at(old, layout(100, 3, 0, 2, None))
    assert not found.exact and "the epochs end differently" in (found.reason or "")


def test_another_seed_or_dataset_is_not_exact() -> None:
    old = [saved((0, 2), layout(100, 2, r, 2, 24)) for r in range(2)]
    assert "sampler seed" in (data_order.continue_at(old, layout(100, 4, 0, 2, 24, seed=1)).reason or "")
    assert "dataset length" in (data_order.continue_at(old, layout(104, 4, 0, 2, 24)).reason or "")


def test_ranks_the_saving_run_lacked_get_seeds_of_their_own_that_repeat() -> None:
    ranks = [{"rng": {"torch": torch.get_rng_state()}, "data": {"epoch": 0, "batches": 0}} for _ in range(2)]
    third, again, fourth = (data_order.other_size(ranks, r) for r in (2, 2, 3))
    assert third["data"]["rng_how"] == again["data"]["rng_how"] != fourth["data"]["rng_how"]
    assert torch.equal(third["rng"]["torch"], again["rng"]["torch"])
    assert data_order.other_size(ranks, 1)["data"]["rng_how"] == "old rank 1's"


def test_another_size_carries_every_old_position_and_what_to_do_when_it_cannot_be_exact() -> None:
    ranks = [{"rng": STATE, "data": {"epoch": 0, "batches": b}} for b in (3, 4)]
    found = data_order.other_size(ranks, 0, "approximate")
    assert found["data"] == {"resize": [r["data"] for r in ranks], "reshard": "approximate", "rng_how": "old rank 0's"}
    assert data_order.other_size([{**ranks[0], "data": None}, ranks[1]], 0)["data"] is None  # nothing to continue


def simulate(
    rng: random.Random, continue_at: Any = data_order.continue_at
) -> tuple[int, dict[int, Counter[int]], bool, int]:
    """One random run: N samples, G, world sizes and preemption points; each attempt continues
    where ``continue_at`` says. Returns (epochs trained, per-epoch counts, every resume exact)."""
    batch = rng.choice([1, 2, 3])
    worlds = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(2, 4))]
    per_micro = [w * batch for w in worlds]
    lcm = 1
    for value in per_micro:
        lcm = lcm * value // math.gcd(lcm, value)
    global_batch = lcm * rng.choice([1, 2])
    n = global_batch * rng.randint(1, 4) + rng.randint(0, global_batch - 1)
    spe = n // global_batch  # optimizer steps per epoch
    total = spe * rng.randint(1, 3)
    cuts = sorted(rng.sample(range(1, total), min(len(worlds) - 1, total - 1)))
    bounds = [0, *cuts, total]
    counts: dict[int, Counter[int]] = {}
    exact = True
    old: list[dict[str, Any]] | None = None
    for world, (first, last) in zip(worlds, itertools.pairwise(bounds), strict=False):
        layouts = [layout(n, world, r, batch, global_batch) for r in range(world)]
        accumulation = layouts[0].accumulation
        if old is None:
            start = (0, 0)
        else:
            continuation = continue_at(old, layouts[0])
            exact = exact and continuation.exact
            start = (continuation.data["epoch"], continuation.data["batches"])
        epoch, batches = start
        limit = layouts[0].epoch_batches
        assert limit is not None
        for _ in range(last - first):  # optimizer steps of this attempt
            for _ in range(accumulation):
                if batches == limit:
                    epoch, batches = epoch + 1, 0
                for rank in range(world):
                    counts.setdefault(epoch, Counter()).update(
                        drawn(n, world, rank, batch, epoch, batches, batches + 1)
                    )
                batches += 1
        old = [saved((epoch, batches), layouts[r]) for r in range(world)]
    return total // spe, counts, exact, n


def test_any_sizes_and_preemption_points_train_each_sample_of_each_epoch_once() -> None:
    """The property: with global_batch_size stated and the new sizes dividing it, every resume is
    exact and each epoch trains the first (N // G) * G positions of its order, each once."""
    rng = random.Random(49)
    for _ in range(2000):
        epochs, counts, exact, n = simulate(rng)
        assert exact
        assert sorted(counts) == list(range(epochs))
        for epoch, seen in counts.items():
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
            assert max(seen.values()) == 1  # no sample twice
            assert set(seen) == set(order[: len(seen)])  # a prefix of the epoch's order: no gap
        assert len({sum(seen.values()) for seen in counts.values()}) == 1  # (N // G) * G each epoch


def test_the_property_fails_when_each_new_rank_continues_old_rank_0s_own_position() -> None:
    """The control: trainfsm before issue 49 (the position of rank 0 at the old size, on every rank)."""

    def rank0(old: list[dict[str, Any]], new: data_order.Layout) -> data_order.Continuation:
        return data_order.Continuation(old[0], None, True, None)

    rng = random.Random(49)
    runs = [simulate(rng, rank0) for _ in range(200)]
    assert any(max(seen.values()) > 1 for _, counts, _, _ in runs for seen in counts.values())


class Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def debug(self, event: str, **fields: Any) -> None:
        self.records.append((event, fields))

    info = debug


def cursor(loader: Any, at: data_order.Layout, old: list[dict[str, Any]], reshard: str = "exact") -> DataCursor:
    found = DataCursor()
    found.attach(loader, None, Log(), at)
    found.resume_later("auto", {"resize": old, "reshard": reshard, "rng_how": "seeded 1"}, rng.seeded(1))
    return found


def test_restore_on_another_size_positions_each_rank_on_its_own_share() -> None:
    old = [saved((0, 6), layout(100, 4, r, 2, 24)) for r in range(4)]  # 48 samples into epoch 0
    for rank in (0, 1):
        new = loader(100, 2, rank, 2)
        resumed = cursor(new, layout(100, 2, rank, 2, 24), old).start()
        assert resumed is not None and (resumed.mode, resumed.batches, resumed.positioned) == ("sampler", 12, 12)
        event = resumed.as_event()
        assert (event["from_world_size"], event["global"], event["exact"], event["approximate"]) == (
            4,
            {"epoch": 0, "samples": 48},
            True,
            None,
        )
        order = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
        assert next(resumed.iterator).tolist() == [order[48 + rank], order[50 + rank]]


def test_a_list_cannot_be_continued_on_another_size_and_restore_says_what_to_do() -> None:
    batches = [torch.tensor([i]) for i in range(8)]
    unknown = data_order.layout_of(batches, 0, 2, 1, None)
    old = [saved((0, 3), unknown) for _ in range(1)]
    with pytest.raises(
        DataReshardError, match=r"saved by 1 rank\(s\) and this run has 2.*draws no torch DistributedSampler"
    ):
        cursor(batches, unknown, old).start()
    resumed = cursor(batches, unknown, old, reshard="approximate").start()
    assert resumed is not None and resumed.batches == 3  # old rank 0 mod 1's own position, replayed
    assert resumed.as_event()["exact"] is False and "DistributedSampler" in resumed.as_event()["approximate"]


def test_a_stateful_loader_on_another_size_replays_its_share() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    old = [saved((0, 6), layout(100, 4, r, 2, 24)) for r in range(4)]
    sampler = DistributedSampler(range(100), num_replicas=2, rank=1, shuffle=True, seed=0)
    new = StatefulDataLoader(range(100), batch_size=2, sampler=sampler)  # type: ignore[arg-type]
    resumed = cursor(new, data_order.layout_of(new, 1, 2, 6, 24), old).start()
    assert resumed is not None and (resumed.mode, resumed.batches, resumed.positioned) == ("skip", 12, 12)
    assert new.state_dict()["_num_yielded"] == 12  # its own count from the epoch's start: a later save is right
