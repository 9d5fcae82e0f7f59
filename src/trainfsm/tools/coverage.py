"""Which positions of each epoch's order a run kept, across world sizes: the data ledger's interval
arithmetic (``trainfsm.tools.ledger``).

At a ``distributed`` layout (the trail's ``data_layout``), rank ``r`` of ``W`` draws its micro-batch
``k`` of an epoch as the positions ``(k*B + j)*W + r``, ``j < B``, of that epoch's order
(``DistributedSampler`` gives rank ``r`` the positions ``r, r + W, r + 2W, ...``). So a rank's
micro-batches ``a .. b-1`` are the positions ``p`` in ``[a*B*W, b*B*W)`` with ``p % W == r``, cut at
the epoch's end: a ``Stretch``. The ledger proves that, per epoch, the stretches the run kept cover
the positions ``[0, end)`` once each, or names the first position covered twice or not at all.

Epochs can hold millions of samples, so no position is ever listed. The stretches' ends cut an
epoch into pieces in which the same stretches are active; within a piece, how many stretches cover
position ``p`` depends only on ``p`` modulo the least common multiple of their world sizes, so one
period of residues decides the whole piece: its first and last position twice or skipped and how
many there are. The work is the number of stretches times that period (the world size itself, when
one attempt's ranks are active).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

#: Past this period (the lcm of world sizes active at once: two attempts of sizes with a huge lcm,
#: overlapping), a piece is not checked position by position but said to be unchecked.
MAX_PERIOD: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class Stretch:
    """Positions ``lo <= p < hi`` with ``p % world == rank`` of epoch ``epoch``'s order: what one rank
    of one attempt kept."""

    epoch: int
    lo: int
    hi: int
    world: int
    rank: int
    attempt: int


def stretch(
    epoch: int,
    first: int,
    end: int,
    *,
    batch: int,
    world: int,
    rank: int,
    attempt: int,
    epoch_samples: int | None = None,
) -> Stretch:
    """Micro-batches ``first .. end-1`` of ``rank`` (of ``world``, ``batch`` samples each) in ``epoch``,
    as positions of the epoch's order; ``epoch_samples`` cuts the last one (a short last micro-batch,
    or the padding's end)."""
    per_micro = batch * world
    lo, hi = first * per_micro, end * per_micro
    if epoch_samples is not None:
        lo, hi = min(lo, epoch_samples), min(hi, epoch_samples)
    return Stretch(epoch, lo, hi, world, rank, attempt)


def position_after(batches: int, *, batch: int, world: int, epoch_samples: int | None = None) -> int:
    """The global position after ``batches`` micro-batches on every rank: ``batches*B*W``, cut at the
    epoch's end."""
    used = batches * batch * world
    return used if epoch_samples is None else min(used, epoch_samples)


@dataclass(frozen=True, slots=True)
class Finding:
    """Positions of one epoch covered twice (or more) or never, in ``[0, end)``: how many, the first
    and the last, and which (attempt, rank) cover the first (none when skipped)."""

    epoch: int
    kind: str  # "twice" or "skipped"
    first: int
    last: int
    count: int
    holders: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class _Tally:
    first: int | None = None
    last: int = -1
    count: int = 0

    def add(self, first: int, last: int, count: int) -> None:
        if count <= 0:
            return
        self.first = first if self.first is None else min(self.first, first)
        self.last = max(self.last, last)
        self.count += count


def check(stretches: list[Stretch], ends: dict[int, int], begins: dict[int, int] | None = None) -> list[Finding]:
    """Per epoch, the positions twice and the positions skipped (at most one finding of each kind).

    ``ends[epoch]``: where an epoch the run finished ends (positions from there on are not trained
    by design); an epoch without one (the run stopped in it) ends where its highest stretch does.
    ``begins[epoch]``: positions below it are taken as given (a trail that begins with a resume
    from a checkpoint it did not save); epochs before the lowest one there are not checked.
    ``ValueError`` when a piece's period exceeds ``MAX_PERIOD``.
    """
    begins = begins or {}
    by_epoch: dict[int, list[Stretch]] = {}
    for s in stretches:
        if s.hi > s.lo:
            by_epoch.setdefault(s.epoch, []).append(s)
    epochs = set(by_epoch) | set(ends)
    if not epochs:
        return []
    lowest = min(begins) if begins else 0
    findings: list[Finding] = []
    for epoch in range(lowest, max(epochs) + 1):
        items = by_epoch.get(epoch, [])
        end = ends.get(epoch, max((s.hi for s in items), default=0))
        findings.extend(_epoch(epoch, items, begins.get(epoch, 0), end))
    return findings


def _epoch(epoch: int, items: list[Stretch], begin: int, end: int) -> list[Finding]:
    cuts = sorted(
        {begin, end} | {s.lo for s in items if begin < s.lo < end} | {s.hi for s in items if begin < s.hi < end}
    )
    starting: dict[int, list[Stretch]] = {}
    for s in items:
        starting.setdefault(max(s.lo, begin), []).append(s)
    twice, skipped = _Tally(), _Tally()
    holders: tuple[tuple[int, int], ...] = ()
    active: list[Stretch] = []
    for p, q in pairwise(cuts):
        active = [s for s in active if s.hi > p] + [s for s in starting.get(p, []) if s.hi > p]
        first_twice = _piece(p, q, active, twice, skipped)
        if first_twice is not None and first_twice == twice.first:
            holders = tuple(sorted((s.attempt, s.rank) for s in active if first_twice % s.world == s.rank % s.world))
    found = []
    if twice.first is not None:
        found.append(Finding(epoch, "twice", twice.first, twice.last, twice.count, holders))
    if skipped.first is not None:
        found.append(Finding(epoch, "skipped", skipped.first, skipped.last, skipped.count))
    return found


def _piece(p: int, q: int, active: list[Stretch], twice: _Tally, skipped: _Tally) -> int | None:
    """Tally the positions ``[p, q)`` covered twice or never by ``active`` (each spans the piece);
    returns the first position covered twice, if any."""
    if not active:
        skipped.add(p, q - 1, q - p)
        return None
    period = 1
    for world in {s.world for s in active}:
        period = math.lcm(period, world)
    if period > MAX_PERIOD:
        raise ValueError(f"world sizes {sorted({s.world for s in active})} overlap with a period of {period} positions")
    cover = [0] * period
    for s in active:
        for residue in range(s.rank % s.world, period, s.world):
            cover[residue] += 1
    first_twice = None
    for residue, times in enumerate(cover):
        if times == 1:
            continue
        first = p + (residue - p) % period
        if first >= q:
            continue
        last = q - 1 - (q - 1 - residue) % period
        count = len(range(first, q, period))
        if times == 0:
            skipped.add(first, last, count)
        else:
            twice.add(first, last, count)
            first_twice = first if first_twice is None else min(first_twice, first)
    return first_twice


def spans(stretches: list[Stretch]) -> list[tuple[int, int]] | None:
    """The positions of one epoch that ``stretches`` (one attempt's ranks) cover together, as
    ``[lo, hi)`` intervals, when every rank of the world size covers the same ones; else None."""
    if not stretches:
        return []
    world = stretches[0].world
    pieces: dict[tuple[int, int], set[int]] = {}
    for s in stretches:
        if s.world != world:
            return None
        pieces.setdefault((s.lo, s.hi), set()).add(s.rank)
    if any(ranks != set(range(world)) for ranks in pieces.values()):
        return None
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(pieces):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged
