"""The data ledger: did the run, across all its attempts, keep every micro-batch exactly once?

Its words (``trainfsm.tools.ledger_words``; docs/guides/audit-trail.md, "Exactly once: the data
ledger"): a **micro-batch** is one draw from the data loader (one forward and backward), numbered
from 0 in each epoch on each rank. An attempt **kept** what it drew up to the save the next attempt
resumed from (the last attempt: up to its end); what it drew after that save is **not kept** (its
weights were lost, so the next attempt draws those again: exact resume, not a repeat). A kept
micro-batch may be **drawn, not trained** on purpose (``loss=None``, a non-finite retry, an fp16
scaler skip, the data running out mid-step): named with its step.

The counts are ``trainfsm.tools.replay``'s: an attempt starts at epoch 0 micro-batch 0 or where
``data_resumed`` says; each entry into ACCUMULATE draws one; an ``epoch`` event starts the next
epoch; ``data_exhausted`` drew none. The **lineage** is the chain of attempts the run's last weights
come from: the last attempt, the one that saved the checkpoint it resumed from, and so on. Per rank:

- **saved as counted**: the position a save recorded (``checkpoint_saved.data``) is the count then;
- **resumed as saved**: a resume on the saving run's world size restored the position saved with
  the checkpoint it loaded (the same checksum: the same save);
- **the same micro-batches**: two fingerprints of one rank at one (world size, epoch, micro-batch),
  one drawn by an attempt and one by an attempt resumed from it (directly or not), are equal: the
  micro-batch after a save and the first after its resume (compared with each other by the
  checkpoint, wherever the resumed count stands), each epoch's first. These are the only
  reading of the loader (the counts are the trainer's own); a resumed loader that drew another
  micro-batch first is named by the fingerprint it matches (the epoch's first, say);
- **no silent restart**: a fresh start after an earlier attempt saved a complete checkpoint, without
  ``CheckpointingHook(load=None)``, trains those micro-batches again.

Across a change of world size or of per-rank batch size (``data_layout``, format 4), each rank's
kept micro-batches are mapped to positions of each epoch's order (``trainfsm.tools.ledger_positions``,
``trainfsm.tools.coverage``): per epoch their union must be a prefix of the order, no position
twice, or the first position twice or skipped is named.

A break is a run problem of kind ``ledger`` (``trainfsm audit`` exits 1). What cannot be checked
(an older trainfsm's trail, ``data_resume="none"``, a change of world size without a known order
or with a rank whose draws the trail lacks)
is a note, and the line says so: the ledger never certifies what it did not check. A resume the user
accepted as approximate (``CheckpointingHook(data_reshard="approximate")``) is a note with what it
cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from trainfsm.tools import coverage, ledger_fingerprints, ledger_positions, ledger_words
from trainfsm.tools.ledger_words import ONCE, POSITIONS_ONCE, micro_text, proven, ranks_count
from trainfsm.tools.replay import Problem, RankAttempt
from trainfsm.tools.report import AttemptReport
from trainfsm.tools.words import group_by, ranks_text
from trainfsm.trail.reader import Note

__all__ = ["KIND", "ONCE", "POSITIONS_ONCE", "Ledger", "Segment", "check", "proven", "saved_position"]

KIND: Final = "ledger"

Position = tuple[int, int]  # (epoch, micro-batches drawn in it)
Key = tuple[int, int | None, int | None, int, int]  # a fingerprint's (rank, world size, batch size, epoch, micro-batch)


@dataclass(slots=True)
class Ledger:
    """What ``check`` found: run problems, notes, a line per group of ranks (one for all ranks
    across world sizes), and what was proven, how, and what was assumed."""

    problems: list[Problem] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    checked: str = ""


@dataclass(slots=True)
class Segment:
    """One rank's draws in one attempt."""

    r: RankAttempt
    how: str  # fresh, resumed, approximate, complete (at max_steps already), unchecked, nothing (drew nothing)
    why: str | None = None  # unchecked: why; approximate: the reason the user accepted
    begin: Position | None = None
    parent: int | None = None  # the attempt that saved the checkpoint it loaded
    save: dict[str, Any] | None = None  # that save (``checkpoint_saved``'s entry)
    handed: dict[str, Any] | None = None  # its attempt's save that the next attempt resumed from
    kept_to: Position | None = None  # what it kept ends here
    misplaced: bool = False  # resumed at another position than its checkpoint saved: said once, there

    @property
    def checked(self) -> bool:
        return self.how in ("fresh", "resumed")

    @property
    def world(self) -> int | None:
        return (self.r.data.layout or {}).get("world_size") or self.r.world_size

    @property
    def batch(self) -> int | None:
        """The per-rank batch size its micro-batches hold (None: not recorded, an older trail)."""
        return (self.r.data.layout or {}).get("batch_size")

    @property
    def end(self) -> Position | None:
        position = self.r.data.position
        return (position[0], position[1]) if position is not None else None

    def spans(self, begin: Position, end: Position) -> list[tuple[int, int, int]]:
        """This rank's micro-batches from ``begin`` up to ``end``, epoch by epoch: (epoch, first, end)."""
        return self.r.data.spans(begin, end)


def saved_position(data: dict[str, Any] | None, rank: int) -> Position | None:
    """The position a save recorded for ``rank`` (``checkpoint_saved.data``); None when that save
    has none for it (a rank the saving run did not have)."""
    if not data:
        return None
    if "ranks" in data:
        ranks = data["ranks"]
        return (int(ranks[rank][0]), int(ranks[rank][1])) if rank < len(ranks) else None
    return int(data["epoch"]), int(data["batches"])


def check(attempts: list[AttemptReport]) -> Ledger:
    """The ledger over ``attempts`` (in order)."""
    return Check(attempts).run()


class Check:
    """The ledger's state while it checks: each rank's segments, the lineage, what broke."""

    def __init__(self, attempts: list[AttemptReport]) -> None:
        self.attempts = attempts
        self.out = Ledger()
        self.segments: dict[int, dict[int, Segment]] = {}  # attempt -> rank -> segment
        self.saves: dict[tuple[int, str | None], tuple[int, dict[str, Any]]] = {}  # (step, checksum)
        self.parent: dict[int, int | None] = {}  # attempt -> the attempt it resumed from
        self.lineage: list[int] = []  # the attempts the run's last weights come from, in order
        self.broken: set[int] = set()  # ranks with a break
        self.pairs = self.differ = 0  # fingerprint pairs compared, and those that differ
        self.unpaired: list[str] = []  # same-size resumes whose first micro-batch had nothing to match
        self.mapped = False  # across world sizes: the kept micro-batches were mapped to positions and checked

    def problem(self, r: RankAttempt, message: str, line: int | None = None) -> None:
        self.out.problems.append(Problem(KIND, message, r.file, line or r.end_line, r.rank, r.attempt))
        self.broken.add(r.rank)

    def note(self, message: str) -> None:
        if all(n.message != message for n in self.out.notes):
            self.out.notes.append(Note(message))

    def run(self) -> Ledger:
        for attempt in self.attempts:
            rank0 = next((r for r in attempt.ranks if r.rank == 0), None)
            own_saves = [s for s in (rank0.saved if rank0 is not None else []) if s.get("data") is not None]
            self.segments[attempt.attempt] = {r.rank: self._start(r) for r in attempt.ranks}
            for r in attempt.ranks:
                self._saved_as_counted(r, own_saves)
            for save in own_saves:
                self.saves[(int(save["step"]), save.get("checksum"))] = (attempt.attempt, save)
        self._link()
        for segments in self.segments.values():
            for seg in segments.values():
                self._resumed_as_saved(seg)
            self._continued_as_saved(list(segments.values()))
        ledger_fingerprints.compare(self)
        sizes, batches = self.sizes(), self.batches()
        if len(sizes) > 1 or len(batches) > 1:  # micro-batch counts mean other samples: positions
            ledger_positions.across(self, ledger_words.change(sizes, batches))
        else:
            ledger_words.rank_lines(self)
        self.out.checked = ledger_words.checked(self, sizes, batches)
        return self.out

    # ---------------------------------------------------------------- where each attempt began
    def _start(self, r: RankAttempt) -> Segment:
        """How this rank's attempt began, and from which save."""
        start = r.data.start
        old = r.format is None or r.format < 3
        if start is None and not old:  # ended before RESTORE said where its data began: drew nothing
            return Segment(r, "nothing")
        if old or start is None:
            why = f"its trail (format {r.format or 'unknown'}) has no data ledger: written by an older trainfsm"
            return self._unchecked(Segment(r, "unchecked", why))
        seg = Segment(r, start["how"], start.get("why"))
        loaded = r.loaded[-1] if r.loaded else None
        if loaded is not None and seg.how != "fresh":
            found = self.saves.get((int(loaded["step"]), loaded.get("checksum"))) or self._unlogged(r, loaded)
            if found is not None:
                seg.parent, seg.save = found
        if seg.how == "fresh":
            seg.begin = (0, 0)
            self._silent_restart(seg)
        elif seg.how == "pending":  # no data_resumed: at max_steps already, or no position to restore
            if r.micro_batches == 0 and (r.exit or {}).get("reason") == "completed":
                seg.how = "complete"
            elif r.micro_batches == 0:  # killed, or preempted, in RESTORE: before its data was positioned
                seg.how = "nothing"
            else:
                trainloop = loaded is not None and loaded.get("format") == "trainloop"
                seg.how = "unchecked"
                seg.why = "the checkpoint it loaded has no data position for it" + (
                    " (a trainloop checkpoint)" if trainloop else ""
                )
        elif seg.how == "resumed":
            seg.begin = (int(start["epoch"]), int(start["batches"]))
            if start.get("exact") is False:
                seg.how, seg.why = "approximate", start.get("approximate") or "not exact"
                self.note(f"attempt {r.attempt}: resumed on another world size approximately, as accepted: {seg.why}")
            if seg.save is None:
                self.note(
                    f"attempt {r.attempt}: resumed from checkpoint {start.get('from_step')} ({start.get('path')}), "
                    f"which no earlier attempt in this trail saved (another run's, or a trail that begins later): "
                    f"its position is taken as given"
                )
        return self._unchecked(seg) if seg.how == "unchecked" else seg

    def _unlogged(self, r: RankAttempt, loaded: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """The save of a checkpoint ``r`` loaded that no ``checkpoint_saved`` records: an asynchronous
        save is logged at the step after it became durable, so a kill in between loses the event.
        The latest earlier attempt, killed, that logged no save of that step and whose every rank
        entered CHECKPOINT at it saved it; its position is what they counted there (what the event
        would have said). None if none did (another run's checkpoint)."""
        step = int(loaded["step"])
        for attempt in reversed([a for a in self.attempts if a.attempt < r.attempt]):
            logged = any(int(save["step"]) == step for x in attempt.ranks for save in x.saved)
            if not attempt.killed or logged:
                continue
            ranks = sorted(attempt.ranks, key=lambda x: x.rank)
            counted = [x.data.positions[step] for x in ranks if step in x.data.positions]
            if [x.rank for x in ranks] != list(range(ranks[0].world_size or 0)) or len(counted) != len(ranks):
                continue
            data: dict[str, Any] = {"ranks": [list(c) for c in counted]}
            if len(set(counted)) == 1:
                data = {"epoch": counted[0][0], "batches": counted[0][1]}
            save = {"step": step, "path": loaded.get("path"), "checksum": loaded.get("checksum"), "data": data}
            self.saves[(step, loaded.get("checksum"))] = (attempt.attempt, save)
            self.note(
                f"attempt {r.attempt}: resumed from checkpoint {step} ({loaded.get('path')}), whose checkpoint_saved "
                f"attempt {attempt.attempt} never wrote (killed before logging it, as after an asynchronous save): "
                f"its position is taken from what attempt {attempt.attempt}'s ranks counted entering CHECKPOINT at "
                f"step {step}"
            )
            return attempt.attempt, save
        return None

    def _unchecked(self, seg: Segment) -> Segment:
        self.note(f"attempt {seg.r.attempt}: the data ledger is not checked: {seg.why}")
        return seg

    def _silent_restart(self, seg: Segment) -> None:
        r = seg.r
        earlier = [(a, s) for (a, s) in self.saves.values() if a < r.attempt]
        if not earlier or r.not_loaded:
            return
        a, newest = max(earlier, key=lambda item: item[1]["step"])
        upto = saved_position(newest["data"], r.rank)
        again = f"the micro-batches before {micro_text([(upto[0], upto[1], upto[1] + 1)])}" if upto else "its data"
        self.problem(
            r,
            f"rank {r.rank}, attempt {r.attempt} started from scratch (step 0, epoch 0 micro-batch 0) although "
            f"attempt {a} saved checkpoint {newest['step']} completely ({newest['path']}): {again} are trained "
            f"again (pass CheckpointingHook(load=None) to start afresh on purpose)",
        )

    def _link(self) -> None:
        """The lineage (from the last attempt that began, back through the saves each resumed
        from), and for each attempt the save the next one resumed from: what it kept ends there."""
        for a, segments in self.segments.items():
            self.parent[a] = next((s.parent for s in segments.values() if s.parent is not None), None)
        began = [a for a, segments in self.segments.items() if any(s.how != "nothing" for s in segments.values())]
        at = began[-1] if began else None
        while at is not None:
            self.lineage.insert(0, at)
            at = self.parent[at]
        handed: dict[int, dict[str, Any]] = {}
        for a in [*self.segments, *self.lineage]:  # the last resume from an attempt wins, then the lineage's
            seg = next((s for s in self.segments[a].values() if s.save is not None), None)
            if seg is not None and seg.parent is not None:
                handed[seg.parent] = seg.save  # type: ignore[assignment]
        last = self.lineage[-1] if self.lineage else None
        for a, segments in self.segments.items():
            for seg in segments.values():
                if a in handed:
                    seg.handed = handed[a]
                    seg.kept_to = saved_position(handed[a]["data"], seg.r.rank) or seg.end
                else:  # the last attempt keeps what it drew; one nobody resumed from, nothing
                    seg.kept_to = seg.end if a == last else seg.begin

    # ---------------------------------------------------------------- per rank
    def _saved_as_counted(self, r: RankAttempt, own_saves: list[dict[str, Any]]) -> None:
        for save in own_saves:
            saved = saved_position(save["data"], r.rank)
            counted = r.data.positions.get(save["step"])
            if saved is not None and counted is not None and saved != counted:
                self.problem(
                    r,
                    f"rank {r.rank}, attempt {r.attempt}: checkpoint {save['step']} saved epoch {saved[0]} with "
                    f"{saved[1]} micro-batches drawn, but the trail counts epoch {counted[0]} with {counted[1]} drawn "
                    f"by then: the loader's position and its draws disagree",
                )

    def _resumed_as_saved(self, seg: Segment) -> None:
        r = seg.r
        if seg.how != "resumed" or seg.save is None or seg.begin is None or seg.parent is None:
            return
        if self.relaid(seg.parent, seg):  # another world size or batch: positions, not counts
            return
        saved = saved_position(seg.save["data"], r.rank)
        if saved is None or saved == seg.begin:
            return
        seg.misplaced = True
        if seg.begin < saved:
            what = f"{ledger_words.between(seg.begin, saved)} trained twice"
        else:
            what = f"{ledger_words.between(saved, seg.begin)} skipped"
        self.problem(
            r,
            f"rank {r.rank}, attempt {r.attempt} resumed from checkpoint {seg.save['step']} (saved by attempt "
            f"{seg.parent}) at epoch {seg.begin[0]} micro-batch {seg.begin[1]}, but that checkpoint saved epoch "
            f"{saved[0]} micro-batch {saved[1]} as the next: {what}",
            (r.data.start or {}).get("line"),
        )

    def _continued_as_saved(self, segments: list[Segment]) -> None:
        """An attempt resumed on another world size: the global position it says it continued from
        (``data_resumed.global``) is the one its checkpoint saved (``checkpoint_saved.data.global``),
        and each rank's own count stands there. One problem per attempt, its ranks named."""
        resized = [
            s
            for s in segments
            if s.how == "resumed" and s.save is not None and s.parent is not None and s.begin is not None
            and self.world_of(s.parent, s.r.rank) is not None and self.relaid(s.parent, s)
        ]  # fmt: skip
        if not resized:
            return
        first = resized[0]
        step, saved = first.save["step"], first.save["data"].get("global")  # type: ignore[index]
        claimed = (first.r.data.start or {}).get("global")
        line = (first.r.data.start or {}).get("line")
        if not claimed:
            return
        if saved and (claimed["epoch"], claimed["samples"]) != (saved["epoch"], saved["samples"]):
            self.problem(
                first.r,
                f"attempt {first.r.attempt} on {ranks_count(first.world)} continued from epoch {claimed['epoch']} "
                f"position {claimed['samples']} (data_resumed.global), but checkpoint {step} saved epoch "
                f"{saved['epoch']} position {saved['samples']}",
                line,
            )
            return
        layout = first.r.data.layout or {}
        if layout.get("order") != "distributed" or not layout.get("batch_size"):
            return
        batch, world, samples = int(layout["batch_size"]), int(layout["world_size"]), layout.get("epoch_samples")

        def counted(seg: Segment) -> tuple[int, int]:
            epoch, batches = seg.begin  # type: ignore[misc]
            return epoch, coverage.position_after(batches, batch=batch, world=world, epoch_samples=samples)

        wrong = group_by([s for s in resized if counted(s) != (claimed["epoch"], claimed["samples"])], counted)
        for (epoch, position), group in list(wrong.items())[:1]:
            ranks, micro = ranks_text([s.r.rank for s in group]), (group[0].begin or (0, 0))[1]
            self.problem(
                group[0].r,
                f"attempt {first.r.attempt} on {ranks_count(world)} says it continued checkpoint {step}'s position "
                f"{claimed['samples']} of epoch {claimed['epoch']} (data_resumed.global), but {ranks} counted from "
                f"micro-batch {micro} of epoch {epoch}, which is position {position} at {ranks_count(world)} with "
                f"batches of {batch}: the ranks did not skip to the global position",
                line,
            )

    def world_of(self, attempt: int, rank: int) -> int | None:
        seg = self.segments[attempt].get(rank)
        return seg.world if seg is not None else None

    def relaid(self, attempt: int, seg: Segment) -> bool:
        """Whether ``seg`` draws micro-batches of another shape than its rank did in ``attempt``
        (another world size, or another per-rank batch size where both are recorded), or its rank
        was not there: its counts are then compared as positions, not as counts."""
        before = self.segments[attempt].get(seg.r.rank)
        if before is None or before.world != seg.world:
            return True
        return before.batch is not None and seg.batch is not None and before.batch != seg.batch

    def _ancestors(self, attempt: int) -> list[int]:
        found, at = [], self.parent.get(attempt)
        while at is not None:
            found.append(at)
            at = self.parent.get(at)
        return found

    # ---------------------------------------------------------------- across world sizes
    def sizes(self) -> list[int]:
        """The lineage's world sizes, each change once: [4, 2, 3]."""
        sizes: list[int] = []
        for a in self.lineage:
            worlds = {s.world for s in self.segments[a].values() if s.how != "nothing" and s.world is not None}
            for world in sorted(worlds):
                if not sizes or sizes[-1] != world:
                    sizes.append(world)
        return sizes

    def batches(self) -> list[int]:
        """The lineage's per-rank batch sizes where recorded, each change once: [2, 1]."""
        batches: list[int] = []
        for a in self.lineage:
            known = {s.batch for s in self.segments[a].values() if s.how != "nothing" and s.batch is not None}
            for batch in sorted(known):
                if not batches or batches[-1] != batch:
                    batches.append(batch)
        return batches
