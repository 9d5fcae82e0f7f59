"""Reading the audit trail back: finding the rank files of a run and streaming their events.

Shared by ``trainfsm audit``, ``trace`` and ``plot``. A trail can be huge (a week-long run writes
several transitions per step), so files are streamed line by line and nothing here keeps them in
memory: each command folds the records into the little it needs.

What counts as unreadable (``TrailError``, the commands exit 2) and what is tolerated (a ``Note``):

- a missing file, an empty file, a directory without ``logs/events.rank*.jsonl``: unreadable; but a
  rank file found in a run's directory that is empty beside other ranks' events is noted and left
  out (the rank was killed before its first write): the audit names the rank it has no trail of;
- a rank's trail is its closed segments (``events.rank0.00001.jsonl.gz``, ...) then the file being
  written, read in that order as one stream, compressed or not (``trainfsm.trail.files``);
- a complete line (it ends with a newline) that is not a JSON object carrying the common fields
  (``ts``, ``event``, ``rank``, ``step``, ``state``, ``attempt``): unreadable, naming file and line;
- a ``run_start`` whose ``format`` is not one of ``READABLE_FORMATS``: unreadable (a newer
  writer's trail); format 1 (every transition verbatim) and 2 (compact ``steps`` records) are read;
- a ``steps`` record whose fields do not add up (``dt`` not one duration per step): unreadable;
- a last line without its newline that does not parse: the writer was killed mid-line. Noted,
  skipped;
- a line whose start is such a cut-off line and whose rest is the next attempt's ``run_start``
  (the restarted process appended to the cut-off file): noted, the ``run_start`` is kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from trainfsm.machine import ROUTINE_END, ROUTINE_NEXT, ROUTINE_START
from trainfsm.trail.files import (
    ANY_FILE,
    LOGS,
    active_name,
    closed_segments,
    files_of,
    is_segment,
    open_segment,
    rank_of,
)
from trainfsm.trail.schema import FORMAT_VERSION, READABLE_FORMATS, transition_event

try:  # orjson parses a line several times faster than json; both accept the same lines.
    import orjson

    _loads: Any = orjson.loads
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _loads = json.loads

_DECODE_ERRORS: Final = (ValueError, UnicodeDecodeError)

#: Fields every event carries (``run_id`` too, but only as information).
REQUIRED_FIELDS: Final[dict[str, type | tuple[type, ...]]] = {
    "ts": (int, float),
    "event": str,
    "rank": int,
    "step": int,
    "state": str,
    "attempt": int,
}
TRANSITION_FIELDS: Final = ("trigger", "source", "dest")
_NUMBERS: Final = (float, int)


class TrailError(Exception):
    """The input cannot be read as an audit trail; the message names the file (and line)."""


@dataclass(frozen=True, slots=True)
class Note:
    """Something tolerated but worth saying (a truncated last line, a missing rank file)."""

    message: str
    file: str | None = None
    line: int | None = None

    def where(self) -> str:
        return _where(self.file, self.line)

    def as_dict(self) -> dict[str, Any]:
        return {"message": self.message, "file": self.file, "line": self.line}


class Record:
    """One event of the trail, its common fields, and where it was read (for messages that point at
    the line). The common fields are attributes: the replay reads them for every line."""

    __slots__ = ("attempt", "data", "file", "line", "name", "rank", "state", "step", "ts")

    def __init__(self, file: str, line: int, data: dict[str, Any]) -> None:
        self.file, self.line, self.data = file, line, data
        self.name: str = data["event"]
        self.step: int = data["step"]
        self.state: str = data["state"]
        self.ts: float = data["ts"]
        self.rank: int = data["rank"]
        self.attempt: int = data["attempt"]

    def where(self) -> str:
        return _where(self.file, self.line)

    def __repr__(self) -> str:
        return f"Record({self.where()}: {self.data!r})"


@dataclass(slots=True)
class Trail:
    """The rank files of one run, in rank order, and what reading them had to tolerate."""

    files: list[Path]
    notes: list[Note] = field(default_factory=list)

    def records(self) -> Iterator[Record]:
        """Every event of every file, file by file, each file in its own order."""
        for path in self.files:
            yield from read_records(path, self.notes)


def _where(file: str | None, line: int | None) -> str:
    if file is None:
        return ""
    return f"{file}:{line}" if line is not None else file


def rank_files(directory: Path) -> list[Path]:
    """The trail of each rank of a workspace (under ``logs/``) or of a logs directory, by rank:
    ``events.rank{R}.jsonl``, the name of the file being written, which stands for the rank's
    closed segments too (it may be missing when only segments are left)."""
    for candidate in (directory / LOGS, directory):
        ranks = {rank for p in candidate.glob(ANY_FILE) if (rank := rank_of(p)) is not None}
        if ranks:
            return [candidate / active_name(rank) for rank in sorted(ranks)]
    raise TrailError(f"{directory}: no audit trail here (expected {directory / LOGS / active_name('*')})")


def open_trail(inputs: Iterable[Path]) -> Trail:
    """The trail of ``inputs``: run directories (workspaces) and/or explicit event files."""
    files: list[Path] = []
    found_in_directory: set[Path] = set()
    for item in inputs:
        if item.is_dir():
            found = rank_files(item)
            found_in_directory.update(found)
        elif item.is_file() or (rank_of(item) is not None and closed_segments(item)):
            found = [item]
        else:
            raise TrailError(f"{item}: no such file or directory")
        for path in found:
            if path.resolve() not in {f.resolve() for f in files}:
                files.append(path)
    if not files:
        raise TrailError("no audit trail given")
    empty = [path for path in files if all(part.stat().st_size == 0 for part in _parts(path))]
    # A rank killed before its first flush (or a full disk) leaves its file empty: among other
    # ranks' events that is a rank without a trail, for the audit to say; named alone, an error.
    if any(path not in found_in_directory for path in empty) or len(empty) == len(files):
        raise TrailError(f"{empty[0]}: the file is empty (no events)")
    notes = [Note("the file is empty: this rank wrote no event (killed before its first write?); left out", str(p))
             for p in empty]  # fmt: skip
    return Trail([path for path in files if path not in empty], notes)


def _parts(path: Path) -> list[Path]:
    """The files that make up ``path``'s trail: a closed segment given by name is itself alone."""
    if is_segment(path):
        return [path]
    return files_of(path) or [path]


def read_records(
    path: Path, notes: list[Note], routine: Callable[[dict[str, Any], str, int], bool] | None = None
) -> Iterator[Record]:
    """Stream ``path``'s events, its closed segments first; tolerated damage is appended to
    ``notes`` (see the module doc).

    ``routine(data, file, line)``, when given, sees each well-formed ``steps`` record first; when
    it returns True it has taken the record and no ``Record`` is made (the audit's fast path: most
    lines of a long trail are such records)."""
    count = 0
    loads = _loads
    for part in _parts(path):
        file = str(part)
        try:
            handle = open_segment(part)
        except OSError as exc:
            raise TrailError(f"{part}: cannot read ({exc.strerror or exc})") from None
        with handle:
            try:
                for number, raw in enumerate(handle, 1):
                    try:  # the common case first, in line: a week-long trail has millions of lines
                        data = loads(raw)
                        good = type(data) is dict and data.get("event") == "steps" and _routine_ok(data)
                    except _DECODE_ERRORS:
                        good = False
                    if not good:
                        data = _parse(raw, file, number, notes)
                        if data is None:
                            continue
                    elif routine is not None and routine(data, file, number):
                        count += 1
                        continue
                    count += 1
                    yield Record(file, number, data)
            except (OSError, EOFError) as exc:  # a damaged .gz segment
                raise TrailError(f"{part}: cannot read ({exc})") from None
    if count == 0:
        raise TrailError(f"{path}: no complete events in the file")


def read_events(path: Path | str, rank: int = 0, *, expand: bool = True) -> Iterator[dict[str, Any]]:
    """The events of one rank's trail as dicts, in the order they were written, segments included.

    ``path`` is a workspace, its ``logs`` directory or a rank's ``events.rank{R}.jsonl``. With
    ``expand`` (the default) each compact ``steps`` record is given as the transitions it stands
    for (``expand_steps``), so a reader sees the same transitions whichever form wrote the trail.
    """
    path = Path(path)
    if path.is_dir():
        by_rank = {rank_of(p): p for p in rank_files(path)}
        if rank not in by_rank:
            raise TrailError(f"{path}: no trail of rank {rank} (ranks: {sorted(by_rank)})")  # type: ignore[type-var]
        path = by_rank[rank]
    for record in read_records(path, []):
        if expand and record.name == "steps":
            yield from expand_steps(record.data)
        else:
            yield record.data


def expand_steps(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The transitions a ``steps`` record stands for, as the full form writes them.

    Times: a step's first transition gets the previous step's end (the first step: ``ts`` less
    the sum of ``dt``), its further micro-batches the same time (the record does not keep them),
    and ``stepped`` its end.
    """
    common: dict[str, Any] = {key: data[key] for key in ("rank", "run_id", "attempt") if key in data}
    out: list[dict[str, Any]] = []
    begin = float(data["ts"]) - sum(data["dt"]) / 1e6
    end = begin
    for offset, micros in enumerate(data["dt"]):
        step = data["first"] + offset
        end += micros / 1e6
        for index in range(data["micro"]):
            trigger, source, dest = ROUTINE_START if index == 0 else ROUTINE_NEXT
            out.append(transition_event(begin, step, trigger, source, dest, common))
        trigger, source, dest = ROUTINE_END
        out.append(transition_event(end, step, trigger, source, dest, common))
        begin = end
    return out


def _parse(raw: bytes, file: str, number: int, notes: list[Note]) -> dict[str, Any] | None:
    """One line's event; None for a blank or tolerated cut-off last line; TrailError for anything
    else. This runs for every line: nothing is formatted unless the line is bad."""
    try:
        data = _loads(raw)
    except _DECODE_ERRORS:
        if not raw.strip():
            return None
        where = f"{file}:{number}"
        if not raw.endswith(b"\n"):  # only the last line can lack its newline: a killed writer
            notes.append(Note("the last line is cut off (the writer was killed mid-line); ignored", file, number))
            return None
        data = _after_cut(raw)
        if data is None:
            raise TrailError(f"{where}: not JSON: {_excerpt(raw)}") from None
        notes.append(
            Note(
                "a cut-off line (the writer was killed mid-line) runs into the next attempt's run_start; "
                "the cut-off part is ignored",
                file,
                number,
            )
        )
    _check_event(data, file, number)
    return data  # type: ignore[no-any-return]


def _after_cut(raw: bytes) -> dict[str, Any] | None:
    """The ``run_start`` a restarted writer appended right after a cut-off line, if that is what
    ``raw`` is: a restarted process opens the file for appending and starts with ``run_start``."""
    start = raw.find(b"{", 1)
    while start != -1:
        try:
            data = _loads(raw[start:])
        except _DECODE_ERRORS:
            start = raw.find(b"{", start + 1)
            continue
        if isinstance(data, dict) and data.get("event") == "run_start":
            return data
        return None
    return None


def _check_event(data: Any, file: str, number: int) -> None:
    if not _looks_like_event(data):
        _explain_not_an_event(data, f"{file}:{number}")
    event = data["event"]
    if event == "steps":
        _check_steps(data, file, number)
    elif event == "transition":
        if not (type(data.get("trigger")) is str and type(data.get("source")) is str and type(data.get("dest")) is str):
            missing = next(name for name in TRANSITION_FIELDS if not isinstance(data.get(name), str))
            raise TrailError(f"{file}:{number}: a transition without {missing!r}")
    elif event == "run_start" and data.get("format") not in READABLE_FORMATS:
        where = f"{file}:{number}"
        raise TrailError(
            f"{where}: events of format {data.get('format')!r}; this trainfsm reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))} (it writes {FORMAT_VERSION}; a trail of a newer trainfsm?)"
        )


def _check_steps(data: dict[str, Any], file: str, number: int) -> None:
    first, micro, dt = data.get("first"), data.get("micro"), data.get("dt")
    if not (type(first) is int and type(micro) is int and micro >= 1):
        raise TrailError(f"{file}:{number}: a steps record needs integer 'first' and 'micro' >= 1")
    # sum() in C: an int only if every duration is one (a float or a string would show)
    if not (type(dt) is list and len(dt) == data["step"] - first + 1 and _int_sum(dt)):
        raise TrailError(
            f"{file}:{number}: a steps record of steps {first}-{data['step']} needs one integer duration per "
            f"step in 'dt'"
        )


def _routine_ok(data: dict[str, Any]) -> bool:
    """A well-formed ``steps`` record (the common fields too), checked in one expression; any
    doubt goes to ``_check_event``, which says what is wrong."""
    try:
        first, step, dt, micro = data["first"], data["step"], data["dt"], data["micro"]
        return (
            type(first) is int
            and type(step) is int
            and type(dt) is list
            and len(dt) == step - first + 1
            and type(sum(dt)) is int  # sum() in C: an int only if every duration is one
            and type(micro) is int
            and micro >= 1
            and type(data["ts"]) in _NUMBERS
            and type(data["rank"]) is int
            and type(data["attempt"]) is int
            and type(data["state"]) is str
        )
    except (KeyError, TypeError):
        return False


def _int_sum(values: list[Any]) -> bool:
    try:
        return type(sum(values)) is int
    except TypeError:
        return False


def _looks_like_event(data: Any) -> bool:
    """The common fields with their types, in one expression: this runs for every line."""
    try:
        return (
            type(data["ts"]) in _NUMBERS
            and type(data["event"]) is str
            and type(data["rank"]) is int
            and type(data["step"]) is int
            and type(data["state"]) is str
            and type(data["attempt"]) is int
        )
    except (KeyError, TypeError, IndexError):
        return False


def _explain_not_an_event(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise TrailError(f"{where}: not an audit event (a JSON {type(data).__name__}, not an object)")
    for name, kind in REQUIRED_FIELDS.items():
        value = data.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TrailError(f"{where}: not an audit event: field {name!r} is missing or not {_type_name(kind)}")


def _type_name(kind: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(kind, tuple) else {"str": "a string", "int": "an integer"}[kind.__name__]


def _excerpt(raw: bytes, limit: int = 60) -> str:
    text = raw.decode("utf-8", "replace").rstrip("\n")
    return repr(text if len(text) <= limit else text[:limit] + "...")
