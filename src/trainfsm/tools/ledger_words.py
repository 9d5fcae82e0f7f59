"""The data ledger's words (``trainfsm.tools.ledger`` checks; this says what it found).

One line per group of ranks alike, each attempt of a rank in turn, for a run on one world size::

    rank 0: attempt 0 kept epoch 0 micro-batches 0-7 (steps 1-8, saved in checkpoint 8), then drew
    epoch 0 micro-batch 8 (at least: its trail ends there), not kept; attempt 1 resumed checkpoint 8
    and kept epoch 0 micro-batches 8-9 and epoch 1 micro-batches 0-1 (steps 9-12): each micro-batch
    kept once, none skipped

One line for all ranks across a change of world size, in positions of each epoch's order::

    all ranks, world size 4 → 2: attempt 0 on 4 ranks kept epoch 0 positions 0-71 (...); attempt 1
    on 2 ranks resumed checkpoint 3 and kept epoch 0 positions 72-95 (...): each position kept once,
    none skipped

Then ``checked``: what was proven, how, and what was assumed. Ranges are inclusive here (the
ledger counts with ends exclusive).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from trainfsm.tools import coverage
from trainfsm.tools.words import group_by, ranks_text

if TYPE_CHECKING:
    from trainfsm.tools.ledger import Check, Position, Segment

ONCE: Final = "each micro-batch kept once, none skipped"
POSITIONS_ONCE: Final = "each position kept once, none skipped"
BROKEN: Final = "NOT each micro-batch once (see run problems)"
POSITIONS_BROKEN: Final = "NOT each position once (see run problems)"


def proven(line: str) -> bool:
    """Whether a ledger line certifies its ranks: each micro-batch (or position) kept once."""
    return line.endswith((ONCE, POSITIONS_ONCE))


def ranks_count(world: int | None) -> str:
    """``4 ranks``, ``1 rank``."""
    return f"{world} rank" if world == 1 else f"{world} ranks"


def micro_text(spans: list[tuple[int, int, int]]) -> str:
    """``epoch 0 micro-batches 8-9 and epoch 1 micro-batch 0`` from (epoch, first, end) spans."""
    parts = []
    for epoch, first, end in spans:
        many = f"micro-batches {first}-{end - 1}" if end - first > 1 else f"micro-batch {first}"
        parts.append(f"epoch {epoch} {many}")
    return " and ".join(parts) if parts else "no micro-batch"


def between(lo: Position, hi: Position) -> str:
    """The micro-batches from ``lo`` up to ``hi`` (not included)."""
    if lo[0] == hi[0]:
        many = f"micro-batches {lo[1]}-{hi[1] - 1}" if hi[1] - lo[1] > 1 else f"micro-batch {lo[1]}"
        return f"{many} of epoch {lo[0]}"
    return f"the micro-batches from epoch {lo[0]} micro-batch {lo[1]} up to epoch {hi[0]} micro-batch {hi[1]}"


def source(fingerprint: dict[str, Any]) -> str:
    """Which draw a fingerprint is of, after "the one attempt N drew"."""
    if fingerprint["after"] == "epoch":
        return f"first in epoch {fingerprint['epoch']}"
    if fingerprint["after"] == "save":
        return f"after saving checkpoint {fingerprint['from_step']}"
    return f"first after resuming from checkpoint {fingerprint['from_step']}"


def finding(found: coverage.Finding, stretches: list[coverage.Stretch]) -> tuple[str, tuple[int, int]]:
    """A finding in words, and the (attempt, rank) to point it at: the later of the first position's
    holders (twice), or the first stretch past the gap (skipped)."""
    where = f"from position {found.first} to {found.last}" if found.last > found.first else f"position {found.first}"
    many = f"{found.count} position{'s' if found.count > 1 else ''} of its order"
    if found.kind == "twice":
        holders = " and ".join(f"attempt {a} rank {rank}" for a, rank in found.holders)
        return f"{many} trained twice, {where} (position {found.first}: {holders})", found.holders[-1]
    later = [s for s in stretches if s.epoch == found.epoch and s.lo > found.first]
    past = min(later, key=lambda s: (s.lo, s.attempt, s.rank)) if later else None
    if past is None:
        last = max(stretches, key=lambda s: (s.attempt, s.rank))
        return f"{many} never trained, {where} (the epoch's end)", (last.attempt, last.rank)
    return f"{many} never trained, {where} (attempt {past.attempt} went on past them)", (past.attempt, past.rank)


# -------------------------------------------------------------------- one world size: a line per rank group
def rank_lines(check: Check) -> None:
    texts: dict[int, str] = {}
    unchecked: dict[int, list[int]] = {}
    for a, segments in check.segments.items():
        for rank, seg in segments.items():
            part = _rank_part(check, seg)
            texts[rank] = f"{texts[rank]}; {part}" if rank in texts else part
            if seg.how == "unchecked":
                unchecked.setdefault(rank, []).append(a)
        world = next((s.world for s in segments.values() if s.world), 0)
        for rank in (rank for rank in range(world) if rank not in segments):  # its file lost: never certified
            part = f"attempt {a}: not checked (the trail has no record of this rank)"
            texts[rank] = f"{texts[rank]}; {part}" if rank in texts else part
            unchecked.setdefault(rank, []).append(a)
    for rank in sorted(texts):
        if rank in check.broken:
            verdict = BROKEN
        elif rank in unchecked:
            verdict = f"not proven: attempt {', '.join(map(str, unchecked[rank]))} not checked (see notes)"
        else:
            verdict = ONCE
        texts[rank] += f": {verdict}"
    for text, ranks in group_by(sorted(texts), lambda rank: texts[rank]).items():
        check.out.lines.append(f"{ranks_text(ranks)}: {text}")


def _rank_part(check: Check, seg: Segment) -> str:
    a = seg.r.attempt
    if seg.how == "nothing":
        return f"attempt {a} ended before its data was positioned: drew nothing"
    if seg.how == "unchecked":
        return f"attempt {a}: not checked (see notes)"
    if seg.how == "complete":
        return f"attempt {a} resumed checkpoint {seg.r.resumed_from_step} at max_steps: nothing left to draw"
    head = f"attempt {a}"
    if seg.save is not None:
        head += f" resumed checkpoint {seg.save['step']} and"
    elif seg.how == "fresh" and a != check.attempts[0].attempt:
        head += " started afresh and"
    begin = seg.begin or (0, 0)
    kept, end = seg.spans(begin, seg.kept_to or begin), seg.end or begin
    if not kept and seg.handed is None and end > begin and check.lineage and a != check.lineage[-1]:
        drawn = micro_text(seg.spans(begin, end))
        return f"{head} drew {drawn} ({_steps(seg)}), not kept: no later attempt resumed from its checkpoints"
    return f"{head} kept {micro_text(kept)} ({_steps(seg)}){_after([seg])}"


def _steps(seg: Segment) -> str:
    r = seg.r
    last = int(seg.handed["step"]) if seg.handed is not None else r.last_step
    if not r.steps_done or last is None or r.first_step is None or last < r.first_step:
        steps = "no step"
    else:
        steps = f"step {last}" if last == r.first_step else f"steps {r.first_step}-{last}"
    return steps + (f", saved in checkpoint {seg.handed['step']}" if seg.handed is not None else "")


def _after(segs: list[Segment]) -> str:
    """What the ranks drew and did not train among what they kept, then what they drew after it
    (not kept); the ranks are named where they differ."""
    texts = []
    for text, group in group_by(segs, _untrained).items():
        if text:
            texts.append(f", of which not trained{_who(segs, group)}: {text}")
    for text, group in group_by(segs, _lost).items():
        if text:
            killed = sum(1 for s in group if s.r.exit is None)
            trails = "its trail ends" if killed == 1 else "their trails end"
            short = f" (at least: {trails} there)" if killed else ""
            texts.append(f", then drew {text}{_who(segs, group)}{short}, not kept")
    return "".join(texts)


def _who(segs: list[Segment], group: list[Segment]) -> str:
    return f" on {ranks_text([s.r.rank for s in group])}" if len(segs) > 1 else ""


#: Micro-batches not trained shown for each reason; the rest are counted.
UNTRAINED_SHOWN: Final = 3


def _untrained(seg: Segment) -> str:
    """``epoch 0 micro-batch 5 at step 6 (loss=None); epoch 0 micro-batch 0 at step 1, ... and 4
    more (the fp16 grad scaler skipped the step)``: by reason, the first few of each."""
    last = int(seg.handed["step"]) if seg.handed is not None else None
    entries = [n for n in seg.r.data.not_trained if last is None or n["step"] <= last]
    texts = []
    for why, alike in group_by(entries, lambda n: n["why"]).items():
        shown = ", ".join(f"{micro_text(n['spans'])} at step {n['step']}" for n in alike[:UNTRAINED_SHOWN])
        more = f" and {len(alike) - UNTRAINED_SHOWN} more" if len(alike) > UNTRAINED_SHOWN else ""
        texts.append(f"{shown}{more} ({why})")
    return "; ".join(texts)


def _lost(seg: Segment) -> str:
    if seg.kept_to is None or seg.end is None or seg.handed is None:
        return ""
    spans = seg.spans(seg.kept_to, seg.end)
    return micro_text(spans) if spans else ""


# -------------------------------------------------------------------- across world sizes: one line
def positions_line(check: Check, change: str, stretches: list[coverage.Stretch], approximate: list[int]) -> str:
    parts = [_attempt_part(check, a, stretches) if a in check.lineage else _abandoned(check, a) for a in check.segments]
    if approximate:
        verdict = f"not proven: attempt {', '.join(map(str, approximate))} continued approximately, as accepted"
    elif check.broken:
        verdict = POSITIONS_BROKEN
    else:
        verdict = POSITIONS_ONCE
    return f"all ranks, {change}: {'; '.join(parts)}{_epoch_size(check)}: {verdict}"


def _abandoned(check: Check, a: int) -> str:
    """An attempt off the lineage: what it drew, none of it kept (its weights were not resumed)."""
    segs = [s for s in check.segments[a].values() if s.how not in ("nothing", "unchecked")]
    if not segs:
        return _rank_part(check, next(iter(check.segments[a].values())))
    first = segs[0]
    head = f"attempt {a} on {ranks_count(first.world)}"
    if first.save is not None:
        head += f" resumed checkpoint {first.save['step']} and"
    drawn = group_by(segs, lambda s: micro_text(s.spans(s.begin or (0, 0), s.end or s.begin or (0, 0))))
    if len(drawn) == 1:
        each = next(iter(drawn)) + (" of each rank" if len(segs) > 1 else "")
    else:
        each = "; ".join(f"{ranks_text([s.r.rank for s in group])}: {text}" for text, group in drawn.items())
    killed = "; at least: their trails end there" if any(s.r.exit is None for s in segs) else ""
    saved = any(attempt == a for attempt, _ in check.saves.values())
    why = "no later attempt resumed from its checkpoints" if saved else "it saved no checkpoint"
    return f"{head} drew {each} ({_steps(first)}{killed}), not kept: {why}"


def change(sizes: list[int], batches: list[int]) -> str:
    """``world size 4 → 2``; ``world size 2, per-rank batch 2 → 1`` when the batch changed too."""
    text = f"world size {' → '.join(map(str, sizes))}"
    return text + (f", per-rank batch {' → '.join(map(str, batches))}" if len(batches) > 1 else "")


def _epoch_size(check: Check) -> str:
    """``; an epoch trains positions 0-95 of the 100 of its order (whole global batches of 24)``, when
    the epoch's end is not its order's end (or ``""``)."""
    layouts = [s.r.data.layout for a in check.lineage for s in check.segments[a].values() if s.r.data.layout]
    sizes = {(layout.get("epoch_samples"), layout.get("length"), layout.get("global_batch")) for layout in layouts}
    if len(sizes) != 1:
        return ""
    ((samples, length, batch),) = sizes
    if samples is None or length is None or samples == length:
        return ""
    why = f"whole global batches of {batch}" if batch else "as the sampler splits it"
    return f"; an epoch trains positions 0-{samples - 1} of the {length} of its order ({why})"


def _attempt_part(check: Check, a: int, stretches: list[coverage.Stretch]) -> str:
    segs = [s for s in check.segments[a].values() if s.how != "nothing"]
    if not segs:
        return f"attempt {a} ended before its data was positioned: drew nothing"
    first = segs[0]
    head = f"attempt {a} on {ranks_count(first.world)}"
    if len(check.batches()) > 1 and first.batch is not None:
        head += f" with batches of {first.batch}"
    if first.how == "complete":
        return f"{head} resumed checkpoint {first.r.resumed_from_step} at max_steps: nothing left to draw"
    if first.save is not None:
        head += f" resumed checkpoint {first.save['step']} and"
    mine = [s for s in stretches if s.attempt == a]
    positions = []
    for epoch in sorted({s.epoch for s in mine}):
        covered = coverage.spans([s for s in mine if s.epoch == epoch])
        text = ", ".join(f"{lo}-{hi - 1}" for lo, hi in covered) if covered else "(its ranks differ)"
        positions.append(f"epoch {epoch} positions {text}")
    micro = group_by(segs, lambda s: micro_text(s.spans(s.begin or (0, 0), s.kept_to or s.begin or (0, 0))))
    if len(micro) == 1:
        each = next(iter(micro)) + (" of each rank" if len(segs) > 1 else "")
    else:
        each = "; ".join(f"{ranks_text([s.r.rank for s in group])}: {text}" for text, group in micro.items())
    return f"{head} kept {' and '.join(positions) or 'no position'} ({each}; {_steps(first)}){_after(segs)}"


# -------------------------------------------------------------------- how
def checked(check: Check, sizes: list[int], batches: list[int]) -> str:
    """What was proven and how, then what was assumed: ``micro-batches counted ...; 2 fingerprint
    pairs compared, all equal; assumed: ...``."""
    if not check.segments:
        return ""
    across = len(sizes) > 1 or len(batches) > 1
    parts = ["micro-batches counted on each rank from its trail (each draw, epoch, save and resume)"]
    if check.pairs:
        equal = "all equal" if not check.differ else f"{check.differ} differ"
        parts.append(f"{check.pairs} fingerprint pair{'s' if check.pairs > 1 else ''} compared, {equal}")
    elif across and not check.unpaired:
        what = "world size" if len(batches) < 2 else "per-rank batch" if len(sizes) < 2 else "world size or batch"
        parts.append(f"no fingerprint could be paired (each resume changed the {what})")
    else:
        parts.append("no fingerprint could be paired")
    if check.unpaired:
        more = ", ..." if len(check.unpaired) > 1 else ""
        parts.append(
            f"{len(check.unpaired)} resume{'s' if len(check.unpaired) > 1 else ''} not compared: no fingerprint of "
            f"the micro-batch the saving run drew next ({check.unpaired[0]}{more})"
        )
    assumed = "the loader draws its order between fingerprints"
    given = {  # a lineage that begins with a resume from a checkpoint this trail did not save
        (int(seg.r.data.start["from_step"]), seg.r.attempt)
        for a in check.lineage[:1]
        for seg in check.segments[a].values()
        if seg.how in ("resumed", "approximate") and seg.save is None and seg.r.data.start
    }
    for step, attempt in sorted(given)[:1]:
        assumed += (
            f"; that checkpoint {step}, which no attempt of this trail saved, holds the data position attempt "
            f"{attempt} resumed"
        )
    if across and not check.mapped:
        parts.append(f"across {change(sizes, batches)}: not mapped to positions (cannot be checked: see notes)")
    elif across:
        parts.append(
            f"across {change(sizes, batches)}: each rank's kept micro-batches mapped to positions of "
            f"each epoch's order (rank r of W holds the positions p with p % W == r), their union checked to be a "
            f"prefix of each epoch's order with no position twice"
        )
        other = "world size" if len(batches) < 2 else "world size or per-rank batch"
        assumed += f"; on another {other} (no fingerprint pairs there), that the loader skipped to its count"
    return f"{'; '.join(parts)}; assumed: {assumed}"
