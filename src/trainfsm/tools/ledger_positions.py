"""The data ledger across a change of layout (``trainfsm.tools.ledger``): another world size, or
another per-rank batch size. A rank's micro-batch is other samples in each layout, so what each rank
of the lineage kept is mapped to positions of each epoch's order (``trainfsm.tools.coverage``), and
per epoch their union must be a prefix of the order, no position twice; or the first position twice
or skipped is named. What cannot be mapped (an order the trainer could not see, a rank whose draws
the trail lacks) is said, never certified."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from trainfsm.tools import coverage, ledger_words
from trainfsm.tools.ledger_words import ranks_count
from trainfsm.tools.words import ranks_text

if TYPE_CHECKING:
    from trainfsm.tools.ledger import Check


def across(check: Check, change: str) -> None:
    """The one line for all ranks across ``change`` (``world size 4 → 2``), its problems and notes."""
    cannot = _cannot_map(check)
    stretches: list[coverage.Stretch] = []
    if not cannot:
        stretches, ends, begins = _stretches(check)
        try:
            findings = coverage.check(stretches, ends, begins)
        except ValueError as error:
            cannot = str(error)
    if cannot:
        check.note(f"the data ledger cannot be checked across {change}: {cannot}")
        check.out.lines.append(f"all ranks, {change}: cannot be checked: {cannot}")
        return
    check.mapped = True
    approximate = [a for a in check.lineage if any(s.how == "approximate" for s in check.segments[a].values())]
    for finding in findings:
        text, blame = ledger_words.finding(finding, stretches)
        text += samples_at(_layout(check), finding)
        if approximate:  # accepted: what it cost is a note
            which = ", ".join(map(str, approximate))
            check.note(f"attempt {which} continued approximately, as accepted: epoch {finding.epoch}: {text}")
            continue
        seg = check.segments[blame[0]].get(blame[1]) or next(iter(check.segments[blame[0]].values()))
        line = (seg.r.data.start or {}).get("line")
        check.problem(seg.r, f"{change}, epoch {finding.epoch}: {text}", line)
    check.out.lines.append(ledger_words.positions_line(check, change, stretches, approximate))


def _cannot_map(check: Check) -> str:
    """Why the lineage's micro-batches cannot be mapped to positions, or ""."""
    for a in check.lineage:
        unseen = _unseen(check, a)
        if unseen:
            return f"attempt {a} on {ranks_count(_world(check, a))}: {unseen}; which samples it drew is unknown"
        for seg in check.segments[a].values():
            if seg.how in ("nothing", "complete"):
                continue
            layout = seg.r.data.layout
            if seg.how == "unchecked" or layout is None:
                why = seg.why or f"its trail (format {seg.r.format}) records no data layout"
                return f"attempt {a} on {ranks_count(seg.world)}: {why}; which samples each rank drew is unknown"
            if layout.get("order") != "distributed" or not layout.get("batch_size"):
                why = f"the order of its samples is unknown: {layout.get('why')}"
                return f"attempt {a} on {ranks_count(seg.world)}: {why}"
    return ""


def _world(check: Check, a: int) -> int | None:
    return next((s.world for s in check.segments[a].values() if s.how != "nothing"), None)


def _unseen(check: Check, a: int) -> str:
    """The ranks of attempt ``a`` whose draws its trail lacks while others drew: no file of
    theirs, or a trail that ends before their data was positioned; "" when none."""
    began = [s for s in check.segments[a].values() if s.how not in ("nothing", "complete")]
    world = _world(check, a)
    if not began or world is None:
        return ""
    missing = [rank for rank in range(world) if rank not in check.segments[a]]
    ended = [s.r.rank for s in check.segments[a].values() if s.how == "nothing"]
    if missing:
        return f"the trail has no record of {ranks_text(missing)}"
    if ended:
        return f"the trail of {ranks_text(ended)} ends before its data was positioned"
    return ""


def _stretches(check: Check) -> tuple[list[coverage.Stretch], dict[int, int], dict[int, int]]:
    """What each rank of the lineage kept, as positions; where each epoch it finished ends; and
    the position a lineage that begins with a resume from another trail's checkpoint took as given."""
    stretches: list[coverage.Stretch] = []
    ends: dict[int, int] = {}
    begins: dict[int, int] = {}
    for a in check.lineage:
        for seg in check.segments[a].values():
            if seg.begin is None or seg.kept_to is None or seg.how in ("nothing", "complete"):
                continue
            layout = seg.r.data.layout or {}
            shape = {"batch": int(layout["batch_size"]), "world": int(layout["world_size"])}
            samples = layout.get("epoch_samples")
            for epoch, first, end in seg.spans(seg.begin, seg.kept_to):
                stretches.append(
                    coverage.stretch(epoch, first, end, rank=seg.r.rank, attempt=a, epoch_samples=samples, **shape)
                )
            if samples is not None:
                ends.update(dict.fromkeys(range(seg.begin[0], seg.kept_to[0]), int(samples)))
            if a == check.lineage[0] and seg.how != "fresh" and seg.save is None:
                begins[seg.begin[0]] = coverage.position_after(seg.begin[1], epoch_samples=samples, **shape)
    return _killed_last(check, stretches), ends, begins


def _killed_last(check: Check, stretches: list[coverage.Stretch]) -> list[coverage.Stretch]:
    """A killed last attempt's ranks each kept up to where their trails were last written: a lower
    bound, and the bounds differ by what each rank had not flushed. Its last epoch is checked up to
    the lowest of them (what its ranks drew past it is not known: not "never trained"), and a note
    says so."""
    last = check.lineage[-1]
    if all(s.r.exit is not None for s in check.segments[last].values() if s.how not in ("nothing", "complete")):
        return stretches
    mine = [s for s in stretches if s.attempt == last]
    if not mine:
        return stretches
    epoch = max(s.epoch for s in mine)
    there = [s for s in mine if s.epoch == epoch]
    world = there[0].world
    known = min(s.hi for s in there) if len({s.rank for s in there}) == world else min(s.lo for s in there)
    if known >= max(s.hi for s in there):
        return stretches
    check.note(
        f"attempt {last} was killed and its ranks' trails end at different micro-batches (each where it was last "
        f"written): epoch {epoch} is checked up to position {known - 1}; what its ranks drew after that is not known"
    )
    cut = [replace(s, hi=min(s.hi, known)) if s.attempt == last and s.epoch == epoch else s for s in stretches]
    return [s for s in cut if s.hi > s.lo]


#: How many of a finding's samples are named: the reader looks them up in the dataset.
SAMPLES_NAMED = 5


def _layout(check: Check) -> dict[str, Any]:
    """A layout of the lineage (length, seed and shuffle are the same in all: else it was refused)."""
    for a in check.lineage:
        for seg in check.segments[a].values():
            if seg.r.data.layout:
                return seg.r.data.layout
    return {}


def samples_at(layout: dict[str, Any], found: coverage.Finding) -> str:
    """The dataset's indices at the finding's first positions, as ``DistributedSampler`` draws them:
    its order of epoch ``e`` is ``torch.randperm(N)`` seeded ``seed + e`` (``range(N)`` without
    shuffle), padded by repeating its start. Positions not all twice (or skipped) between the first
    and the last name the first one's sample only. torch is imported here alone: an audit that
    finds nothing imports none."""
    length, seed, shuffle = layout.get("length"), layout.get("seed"), layout.get("shuffle")
    if not length or seed is None or shuffle is None:
        return ""
    import torch  # here alone (see above)

    n = int(length)
    generator = torch.Generator().manual_seed(int(seed) + found.epoch)
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))
    if found.count != found.last - found.first + 1:
        return f"; position {found.first} is sample {order[found.first % n]} of the dataset"
    shown = [order[p % n] for p in range(found.first, min(found.last, found.first + SAMPLES_NAMED - 1) + 1)]
    more = f" and {found.count - len(shown)} more" if found.count > len(shown) else ""
    word = "samples" if found.count > 1 else "sample"
    return f"; the dataset's {word} {', '.join(map(str, shown))}{more}"
