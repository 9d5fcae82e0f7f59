"""One rank's data in one attempt, as its trail counts it: the data ledger's part of a replay.

``trainfsm.tools.replay`` feeds it the events that move the data (each entry into ACCUMULATE draws
one micro-batch; ``epoch`` starts the next epoch with its first; ``data_exhausted`` took back a draw
that found nothing); ``trainfsm.tools.ledger`` checks what it counted across ranks and attempts.
Positions are ``[epoch, micro-batches drawn in it]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from trainfsm.trail.reader import Record

#: data_resumed's fields of format 4: the saving run's world size, the global position continued
#: from, and whether exactly (``approximate``: the reason the user accepted).
_RESIZE_FIELDS: Final = ("from_world_size", "global", "exact", "approximate")


@dataclass(slots=True)
class DataCount:
    """Where one rank's data stood, counted from its trail."""

    position: list[int] | None = None  # now; None: not known (an old trail, or before RESTORE)
    # How the attempt's data began: fresh, resumed (data_resumed's fields), pending (resumed, no
    # data_resumed yet: none comes at max_steps, or with no position to restore), unchecked.
    start: dict[str, Any] | None = None
    positions: dict[int, tuple[int, int]] = field(default_factory=dict)  # step -> position entering CHECKPOINT
    # batch_fingerprint events, and each epoch's first micro-batch (``after``: "epoch"; format 4)
    fingerprints: list[dict[str, Any]] = field(default_factory=list)
    layout: dict[str, Any] | None = None  # data_layout: how its micro-batches map onto each epoch's order
    epoch_ends: dict[int, int] = field(default_factory=dict)  # micro-batches drawn in each epoch it left
    # Micro-batches drawn and not trained: {"step", "why", "spans": [(epoch, first, end)]}, ends exclusive.
    not_trained: list[dict[str, Any]] = field(default_factory=list)
    try_start: tuple[int, int] | None = None  # where the step's micro-batches (this try) began
    replays: int = 0  # entries into ACCUMULATE still to come that run a kept micro-batch again (``oom``)

    def restored(self, resumed: bool, from_step: int | None, line: int) -> None:
        if not resumed:
            self.position = [0, 0]
            self.start = {"how": "fresh", "epoch": 0, "batches": 0}
        else:  # data_resumed, next, says where the data stands
            self.start = {"how": "pending", "from_step": from_step, "line": line}

    def resumed(self, record: Record, loaded: dict[str, Any]) -> None:
        data = record.data
        self.position = [int(data.get("epoch", 0)), int(data.get("batches", 0))]
        start = {
            "epoch": self.position[0],
            "batches": self.position[1],
            "from_step": data.get("from_step", loaded.get("step")),
            "line": record.line,
            **{key: data.get(key) for key in _RESIZE_FIELDS},
        }
        if data.get("mode") == "none":
            start.update(how="unchecked", why=f"the data position was not restored: {data.get('why')}")
        else:
            start.update(how="resumed", checksum=loaded.get("checksum"), path=loaded.get("path"))
        self.start = start

    def drew(self, first_of_try: bool) -> None:
        """An entry into ACCUMULATE: its micro-batch is drawn first thing (unless an ``oom`` retry
        runs a kept one again: then nothing is drawn, and the try began where it began)."""
        if self.replays:
            self.replays -= 1
            return
        if self.position is not None:
            if first_of_try:  # a step's micro-batches (again, after a retry) from here
                self.try_start = (self.position[0], self.position[1])
            self.position[1] += 1

    def replaying(self, count: int) -> None:
        """``oom``: the next ``count`` entries into ACCUMULATE run the step's kept micro-batches."""
        self.replays = count

    def drew_steps(self, micro_batches: int) -> None:
        """Routine steps (a ``steps`` record): no epoch began in them."""
        if self.position is not None:
            self.position[1] += micro_batches

    def entering_checkpoint(self, step: int) -> None:
        if self.position is not None:
            self.positions[step] = (self.position[0], self.position[1])

    def epoch(self, record: Record) -> None:
        epoch = int(record.data.get("epoch", 0))
        if self.position is not None and epoch > self.position[0]:
            self.epoch_ends[self.position[0]] = self.position[1] - 1  # its last draw began this one
        self.position = [epoch, 1]  # the draw that began it is its first
        if record.data.get("fingerprint") is not None:  # format 4: the epoch's first micro-batch
            self.fingerprints.append(
                {
                    "after": "epoch",
                    "from_step": None,
                    "epoch": epoch,
                    "batches": 1,
                    "fingerprint": record.data["fingerprint"],
                    "line": record.line,
                }
            )

    def fingerprint(self, record: Record) -> None:
        keys = ("after", "from_step", "epoch", "batches", "fingerprint")
        self.fingerprints.append({key: record.data.get(key) for key in keys} | {"line": record.line})

    def exhausted(self, step: int) -> None:
        if self.position is not None:  # the last ACCUMULATE found no batch: nothing was drawn
            self.position[1] -= 1
            self.not_trained_try(step, "the data ran out (max_epochs) before the step's last micro-batch")

    def loss_none(self, step: int) -> None:
        if self.position is not None:  # the micro-batch just drawn
            epoch, batches = self.position
            spans = [(epoch, batches - 1, batches)]
            self.not_trained.append({"step": step, "why": "loss=None", "spans": spans, "try": True})

    def not_trained_try(self, step: int, why: str) -> None:
        """This try's micro-batches were drawn and not trained (they include its ``loss=None`` ones)."""
        if self.position is None or self.try_start is None:
            return
        spans = self.spans(self.try_start, (self.position[0], self.position[1]))
        self.not_trained[:] = [n for n in self.not_trained if not (n["step"] == step and n["try"])]
        if spans:
            self.not_trained.append({"step": step, "why": why, "spans": spans, "try": False})

    def spans(self, begin: tuple[int, int], end: tuple[int, int]) -> list[tuple[int, int, int]]:
        """The micro-batches from ``begin`` up to ``end``, epoch by epoch: (epoch, first, end)."""
        if end <= begin:
            return []
        if begin[0] == end[0]:
            return [(begin[0], begin[1], end[1])]
        per_epoch = (self.layout or {}).get("epoch_batches") or 0
        found = [(begin[0], begin[1], self.epoch_ends.get(begin[0], per_epoch))]
        found += [(epoch, 0, self.epoch_ends.get(epoch, per_epoch)) for epoch in range(begin[0] + 1, end[0])]
        found.append((end[0], 0, end[1]))
        return [span for span in found if span[2] > span[1]]
