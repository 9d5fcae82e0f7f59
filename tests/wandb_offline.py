"""Read wandb's offline run files back, for tests: ``<dir>/wandb/offline-run-*/run-<id>.wandb``.

An offline run keeps its metrics only in this binary file, and wandb ships no reader for it. The
format, as written by wandb 0.31 (wandb-core):

* A 7-byte file header: ``b":W&B"``, the magic ``0xBEE1`` (uint16, little-endian) and a version
  byte, 0.
* Then LevelDB's log framing. The file is cut in 32 KiB blocks (the file header counts towards the
  first). Each physical record has a 7-byte header, checksum (uint32 LE), length (uint16 LE) and
  type (1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST), then ``length`` payload bytes. A record never straddles a
  block: a logical record larger than what is left is split FIRST, MIDDLE..., LAST, and a block tail
  shorter than a header is zero padding.
* The checksum is not LevelDB's masked CRC-32C: it is the plain CRC-32 (zlib's) of the payload,
  seeded with the CRC-32 of the type byte.
* Each logical record is one serialized ``wandb.proto.wandb_internal_pb2.Record``. The ones used
  here: ``run`` (id, project, name, tags, config, start time), ``config`` (later config updates),
  ``history`` (one row: ``step.num`` and items of ``nested_key`` path + ``value_json``),
  ``preempting`` (``run.mark_preempting()``) and ``exit`` (``exit_code``; proto3 leaves 0 out).

A relaunch with the same run id writes a new directory, ``offline-run-<time>-<id>``, with
``-1``, ``-2`` ... appended when the second is the same; ``read_runs`` orders them by start time.
"""

from __future__ import annotations

import importlib
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE_HEADER = struct.Struct("<4sHB")
FILE_IDENT, FILE_MAGIC, FILE_VERSION = b":W&B", 0xBEE1, 0
BLOCK_SIZE = 32 * 1024
RECORD_HEADER = struct.Struct("<IHB")  # checksum, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {kind: zlib.crc32(bytes([kind])) for kind in (FULL, FIRST, MIDDLE, LAST)}


class CorruptRunFile(ValueError):
    """The file is not a wandb run file, or a record fails its checksum or framing."""


def iter_payloads(data: bytes, name: str = "<bytes>") -> Iterator[bytes]:
    """The logical records' payloads of a whole run file's bytes, in order."""
    if len(data) < FILE_HEADER.size:
        raise CorruptRunFile(f"{name}: {len(data)} bytes, shorter than the {FILE_HEADER.size}-byte file header")
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if (ident, magic, version) != (FILE_IDENT, FILE_MAGIC, FILE_VERSION):
        raise CorruptRunFile(f"{name}: header {data[:7]!r} is not {FILE_IDENT!r} magic 0xBEE1 version 0")
    pos = FILE_HEADER.size
    pending: list[bytes] | None = None  # the fragments of a FIRST..LAST record
    while pos < len(data):
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < RECORD_HEADER.size:  # the block's zero padding
            pos += left_in_block
            continue
        if pos + RECORD_HEADER.size > len(data):
            raise CorruptRunFile(f"{name}: truncated record header at byte {pos}")
        checksum, length, kind = RECORD_HEADER.unpack_from(data, pos)
        start, end = pos + RECORD_HEADER.size, pos + RECORD_HEADER.size + length
        if kind == 0 and length == 0 and checksum == 0:  # zeros to the end of the block (preallocated)
            pos += left_in_block
            continue
        if end > len(data) or length > left_in_block - RECORD_HEADER.size:
            raise CorruptRunFile(f"{name}: record at byte {pos} of length {length} overruns its block or the file")
        if kind not in _TYPE_CRC:
            raise CorruptRunFile(f"{name}: record at byte {pos} has unknown type {kind}")
        payload = data[start:end]
        if zlib.crc32(payload, _TYPE_CRC[kind]) != checksum:
            raise CorruptRunFile(f"{name}: checksum mismatch in the record at byte {pos}")
        pos = end
        if kind == FULL:
            if pending is not None:
                raise CorruptRunFile(f"{name}: a FULL record at byte {start - 7} interrupts a fragmented one")
            yield payload
        elif kind == FIRST:
            if pending is not None:
                raise CorruptRunFile(f"{name}: a FIRST record at byte {start - 7} interrupts a fragmented one")
            pending = [payload]
        else:
            if pending is None:
                raise CorruptRunFile(f"{name}: a {'MIDDLE' if kind == MIDDLE else 'LAST'} record without FIRST")
            pending.append(payload)
            if kind == LAST:
                yield b"".join(pending)
                pending = None
    if pending is not None:
        raise CorruptRunFile(f"{name}: the file ends inside a fragmented record")


def iter_records(path: Path) -> Iterator[Any]:
    """Every ``wandb_internal_pb2.Record`` of a run file, in order."""
    wandb_internal_pb2 = importlib.import_module("wandb.proto.wandb_internal_pb2")
    for payload in iter_payloads(Path(path).read_bytes(), str(path)):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def _key(item: Any) -> str:
    """A config item's key."""
    return str(item.key) if item.key else ".".join(item.nested_key)


def _row(items: Any) -> dict[str, Any]:
    """A history row: a ``nested_key`` path of several parts (a logged nested dict, or a media object
    such as an image: ``{"_type": "image-file", "path": ...}``) becomes nested dicts."""
    row: dict[str, Any] = {}
    for item in items:
        path = [str(item.key)] if item.key else list(item.nested_key)
        target = row
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = json.loads(item.value_json)
    return row


@dataclass
class OfflineRun:
    """What one offline run directory holds."""

    path: Path
    run_id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    start_time: float = 0.0
    #: (step, {key: value}) per history row, wandb's own keys (``_step``, ``_runtime``,
    #: ``_timestamp``) left out.
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    preempting: bool = False
    #: The Exit record's code, None when the run file has no Exit record (never finished).
    exit_code: int | None = None


def read_run(path: Path) -> OfflineRun:
    """Read an ``offline-run-*`` directory (or its ``run-<id>.wandb`` file)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{path}: expected one run-*.wandb file, found {[f.name for f in files]}")
    run = OfflineRun(path=files[0].parent)
    for record in iter_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info = record.run
            run.run_id, run.project, run.name = info.run_id, info.project, info.display_name
            run.tags = list(info.tags)
            run.start_time = info.start_time.seconds + info.start_time.nanos / 1e9
            run.config.update({_key(item): json.loads(item.value_json) for item in info.config.update})
        elif kind == "config":
            run.config.update({_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = _row(record.history.item)
            step = record.history.step.num if record.history.HasField("step") else row["_step"]
            run.history.append((int(step), {k: v for k, v in row.items() if not k.startswith("_")}))
        elif kind == "preempting":
            run.preempting = True
        elif kind == "exit":
            run.exit_code = int(record.exit.exit_code)
    run.config.pop("_wandb", None)
    return run


def read_runs(wandb_dir: Path, run_id: str | None = None) -> list[OfflineRun]:
    """Every offline run under ``wandb_dir`` (the ``WANDB_DIR``, or its ``wandb`` subdirectory), oldest
    first; only those of ``run_id`` when given."""
    root = Path(wandb_dir)
    if (root / "wandb").is_dir():
        root = root / "wandb"
    runs = [read_run(path) for path in root.glob("offline-run-*") if path.is_dir()]
    return sorted((run for run in runs if run_id is None or run.run_id == run_id), key=lambda run: run.start_time)


def history(runs: list[OfflineRun]) -> list[tuple[int, dict[str, Any]]]:
    """The history rows of ``runs`` (the attempts of one run), in order."""
    return [row for run in runs for row in run.history]
