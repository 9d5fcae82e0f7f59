"""The data ledger's interval arithmetic across world sizes (``trainfsm.tools.coverage``): a rank's
micro-batches are the positions ``DistributedSampler`` gives it, and the check over a whole run finds
no position twice and none skipped exactly when there is none, naming the first and last of each.

The property tests draw thousands of runs from fixed seeds (``random``; no hypothesis): N samples,
a global batch G, a sequence of world sizes that divide it, and preemption points; each attempt
continues at the global position its predecessor saved, as trainfsm does. Planted breaks shift an
attempt's start on some of its ranks. Every verdict is compared with a brute force that enumerates
each rank's samples by ``DistributedSampler``'s formula."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest
from torch.utils.data import DistributedSampler

from trainfsm.tools import coverage
from trainfsm.tools.coverage import Finding, Stretch


@dataclass
class Attempt:
    world: int
    batch: int
    begin: tuple[int, int]  # (epoch, samples): the global position it starts at
    steps: int  # optimizer steps it keeps


def run_of(rng: random.Random) -> tuple[int, int, list[Attempt]]:
    """A random run: N samples, G, and attempts, each continuing where the last one saved."""
    batch = rng.choice([1, 2, 3])
    worlds = [w for w in (1, 2, 3, 4, 6, 8) if rng.random() < 0.6] or [1]
    global_batch = batch * rng.choice([24, 48, 72])
    worlds = [w for w in worlds if global_batch % (w * batch) == 0]
    samples = rng.randint(global_batch, 6 * global_batch)
    per_epoch = samples // global_batch  # optimizer steps per epoch (the partial global batch dropped)
    total = rng.randint(1, 3 * per_epoch)
    cuts = sorted(rng.sample(range(1, total), min(len(worlds) * 2, total - 1))) if total > 1 else []
    attempts, done = [], 0
    for end in [*cuts, total]:
        begin = (done // per_epoch, (done % per_epoch) * global_batch)
        attempts.append(Attempt(rng.choice(worlds), batch, begin, end - done))
        done = end
    return samples, global_batch, attempts


def stretches_of(samples: int, global_batch: int, attempts: list[Attempt]) -> tuple[list[Stretch], dict[int, int]]:
    """Each rank's kept micro-batches as the ledger maps them (``coverage.stretch``), and the epochs'
    ends. A rank's micro-batch count is its own: global position / (B x W), as trainfsm resumes it."""
    epoch_samples = (samples // global_batch) * global_batch
    stretches: list[Stretch] = []
    last_epoch = 0
    for index, a in enumerate(attempts):
        per_micro = a.batch * a.world
        epoch_batches = epoch_samples // per_micro
        accumulation = global_batch // per_micro
        epoch, first = a.begin[0], a.begin[1] // per_micro
        left = a.steps * accumulation
        while left:
            end = min(epoch_batches, first + left)
            for rank in range(a.world):
                stretches.append(
                    coverage.stretch(
                        epoch,
                        first,
                        end,
                        batch=a.batch,
                        world=a.world,
                        rank=rank,
                        attempt=index,
                        epoch_samples=epoch_samples,
                    )
                )
            left -= end - first
            last_epoch = epoch
            epoch, first = (epoch + 1, 0) if end == epoch_batches else (epoch, end)
    return stretches, dict.fromkeys(range(last_epoch), epoch_samples)


def brute(
    stretches: list[Stretch], ends: dict[int, int], batch: dict[int, int]
) -> list[tuple[int, str, int, int, int]]:
    """Each rank's samples one by one, by DistributedSampler's formula: rank r's micro-batch k holds
    positions (k*B + j)*W + r, j < B (``batch``: B of each attempt)."""
    counts: dict[int, dict[int, int]] = {}
    for s in stretches:
        per_micro = batch[s.attempt] * s.world
        for k in range(s.lo // per_micro, -(-s.hi // per_micro)):
            for j in range(batch[s.attempt]):
                position = (k * batch[s.attempt] + j) * s.world + s.rank
                if s.lo <= position < s.hi:
                    epoch = counts.setdefault(s.epoch, {})
                    epoch[position] = epoch.get(position, 0) + 1
    found = []
    for epoch in sorted(set(counts) | set(ends)):
        seen = counts.get(epoch, {})
        end = ends.get(epoch, max(seen, default=-1) + 1)
        for kind, test in (("twice", lambda n: n > 1), ("skipped", lambda n: n == 0)):
            hit = [p for p in range(end) if test(seen.get(p, 0))]
            if hit:
                found.append((epoch, kind, hit[0], hit[-1], len(hit)))
    return found


def summary(findings: list[Finding]) -> list[tuple[int, str, int, int, int]]:
    return [(f.epoch, f.kind, f.first, f.last, f.count) for f in findings]


# ---------------------------------------------------------------- the mapping is the sampler's
@pytest.mark.parametrize(("samples", "world", "batch"), [(10, 4, 2), (100, 3, 2), (17, 2, 3), (8, 8, 1)])
def test_a_ranks_micro_batches_are_the_positions_distributed_sampler_gives_it(
    samples: int, world: int, batch: int
) -> None:
    """Unshuffled, ``DistributedSampler`` yields positions of the order themselves; padded to a
    multiple of W, and a last micro-batch may be short: ``epoch_samples`` cuts both."""
    epoch_samples = -(-samples // world) * world
    for rank in range(world):
        drawn = list(DistributedSampler(range(samples), num_replicas=world, rank=rank, shuffle=False))
        micro = [drawn[k : k + batch] for k in range(0, len(drawn), batch)]
        for first in range(len(micro) + 1):
            for end in range(first, len(micro) + 1):
                s = coverage.stretch(
                    0, first, end, batch=batch, world=world, rank=rank, attempt=0, epoch_samples=epoch_samples
                )
                positions = [p for p in range(s.lo, s.hi) if p % world == rank]
                # positions past N are the sampler's padding: order[p - N], the first samples again
                assert [p % samples for p in positions] == [i for m in micro[first:end] for i in m]


# ---------------------------------------------------------------- property tests
def test_runs_resumed_across_world_sizes_at_their_global_position_have_no_position_twice_and_none_skipped() -> None:
    rng = random.Random(49)
    started = time.perf_counter()
    for _ in range(2000):
        samples, global_batch, attempts = run_of(rng)
        stretches, ends = stretches_of(samples, global_batch, attempts)
        assert coverage.check(stretches, ends) == [], (samples, global_batch, attempts)
    assert time.perf_counter() - started < 3.0


def test_a_start_moved_on_some_ranks_is_found_as_the_brute_force_finds_it() -> None:
    """One attempt after the first starts some of its ranks a few micro-batches early (trained
    twice) or late (skipped): the check names the same first and last positions and counts as
    enumerating every sample does."""
    rng = random.Random(34)
    planted = 0
    started = time.perf_counter()
    while planted < 1500:
        samples, global_batch, attempts = run_of(rng)
        if len(attempts) < 2:
            continue
        stretches, ends = stretches_of(samples, global_batch, attempts)
        index = rng.randrange(1, len(attempts))
        world = attempts[index].world
        moved = set(rng.sample(range(world), rng.randint(1, world)))
        shift = rng.choice([-3, -2, -1, 1, 2, 3]) * attempts[index].batch * world
        first_epoch = attempts[index].begin[0]
        edited = [
            Stretch(s.epoch, max(0, s.lo + shift), s.hi, s.world, s.rank, s.attempt)
            if s.attempt == index and s.rank in moved and s.epoch == first_epoch and s.lo + shift < s.hi
            else s
            for s in stretches
        ]
        if edited == stretches:
            continue
        planted += 1
        batch = {i: a.batch for i, a in enumerate(attempts)}
        found = summary(coverage.check(edited, ends))
        assert found == brute(edited, ends, batch), (samples, global_batch, attempts, index, moved, shift)
        assert found, "a moved start must show"
    assert time.perf_counter() - started < 3.0


def test_the_first_position_twice_names_every_attempt_and_rank_that_trained_it() -> None:
    old = [Stretch(0, 0, 72, 4, rank, 0) for rank in range(4)]
    new = [Stretch(0, 36, 96, 2, rank, 1) for rank in range(2)]  # every new rank at old rank 0's 9 x 2 x 2
    (twice,) = coverage.check(old + new, {})
    assert (twice.kind, twice.first, twice.last, twice.count) == ("twice", 36, 71, 36)
    assert twice.holders == ((0, 0), (1, 0))


def test_a_billion_sample_epoch_over_1024_then_768_ranks_is_checked_without_listing_positions() -> None:
    per_micro_old, per_micro_new = 4 * 1024, 4 * 768
    cut = 100_000 * per_micro_old  # a multiple of both: the global position handed over
    epoch = (10**9 // (per_micro_old * 3)) * per_micro_old * 3
    old = [Stretch(0, 0, cut, 1024, rank, 0) for rank in range(1024)]
    new = [Stretch(0, cut - 2 * per_micro_new, epoch, 768, rank, 1) for rank in range(768)]  # 2 micro-batches early
    started = time.perf_counter()
    assert coverage.check(old + [Stretch(0, cut, epoch, 768, r, 1) for r in range(768)], {0: epoch}) == []
    (twice,) = coverage.check(old + new, {0: epoch})
    assert (twice.first, twice.last, twice.count) == (cut - 2 * per_micro_new, cut - 1, 2 * per_micro_new)
    assert time.perf_counter() - started < 1.0
