"""The audit trail: what the runtime writes and the offline tools read, in one room.

- ``schema``: every event and its fields (what the writer writes and the readers expect);
- ``files``: where a rank's trail lives (``logs/events.rank{R}.jsonl``) and its rotated segments;
  the only module that spells those names;
- ``writer``: the structlog pipeline a run writes through (``EventLog``);
- ``reader``: reading trails back (``read_events``, ``open_trail``), for tests and the tools.

``schema``, ``files`` and ``reader`` import neither torch nor structlog: the offline commands
(``trainfsm audit``, ``trace``, ``plot``) start without them. So this package's own names are the
reader's: ``from trainfsm.trail import read_events`` is the documented path.
"""

from trainfsm.trail.reader import (
    Note,
    Record,
    Trail,
    TrailError,
    expand_steps,
    open_trail,
    rank_files,
    read_events,
    read_records,
)

__all__ = [
    "Note",
    "Record",
    "Trail",
    "TrailError",
    "expand_steps",
    "open_trail",
    "rank_files",
    "read_events",
    "read_records",
]
