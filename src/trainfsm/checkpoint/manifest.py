"""One checkpoint directory as a reader sees it: its name, its manifest, and the checks made before
a byte of it is unpickled.

A checkpoint is complete when ``manifest.json`` is there (a save writes it last, see
``trainfsm.checkpoint.store``); the manifest lists every file with its size and checksum. Loading checks the
manifest (format, step, sizes, checksums) before ``torch.load(weights_only=True)`` touches a byte,
so neither a truncated file nor a pickle that would run code is ever unpickled.

Checksums: ``xxh3_128`` by default, or ``sha256``. A checksum stored beside the data guards against
torn writes, bit rot and truncation, not against someone who can rewrite the manifest as well, so a
cryptographic hash buys nothing by default. The manifest (format 5) names its algorithm and a load
verifies with whichever one it names; manifests of formats 1-4 still load and verify.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Final

import torch

from trainfsm.checkpoint.io import CHECKSUMS, file_sums

MANIFEST: Final = "manifest.json"
KEEP_SUFFIX: Final = "_keep"
#: 5: the manifest names its "checksum" algorithm and each file has one sum of it ("digest"); a
#: sharded one adds "sharded", "world_size" and each shard's writer ("rank"). Still read: 4 (the
#: same with a sum per chunk, "chunks"), and, all sha256, 3 (format 2, sharded), 2 (a sum per
#: chunk, "sha256_chunks"), 1 (one sum per file, "sha256"). Format 5 manifests written since
#: trainfsm records the order of saves also have "sequence" and "resumed"
#: (``trainfsm.checkpoint.lineage``); a reader that does not know them ignores them.
FORMAT: Final = 5
READS: Final = (1, 2, 3, 4, 5)
#: The manifest's keys for its save's place in the store's order of writing, and for where the run
#: that wrote it started ({"step": resumed from, "sequence": the highest on disk then}).
SEQUENCE: Final = "sequence"
RESUMED: Final = "resumed"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file and the problem."""


def parse_step(name: str) -> tuple[int, bool] | None:
    """(step, kept) for a checkpoint directory name, None for anything else."""
    kept = name.endswith(KEEP_SUFFIX)
    digits = name[: -len(KEEP_SUFFIX)] if kept else name
    return (int(digits), kept) if digits.isdigit() else None


def encode_manifest(
    step: int,
    keep: bool,
    files: dict[str, dict[str, Any]],
    checksum: str,
    sharded_world_size: int | None,
    sequence: int | None = None,
    resumed: tuple[int, int] | None = None,
) -> bytes:
    """The manifest of checkpoint ``step`` listing ``files`` (name -> entry), in the current format;
    ``sharded_world_size``: the world size that wrote a sharded checkpoint, None for a full one;
    ``sequence``: the save's place in its store's order of writing, ``resumed``: (step, sequence)
    where its run started (``trainfsm.checkpoint.lineage``)."""
    from trainfsm import __version__

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "checksum": checksum,
        "step": step,
        "kept": keep,
        "created": time.time(),
        "files": files,
        "versions": {"trainfsm": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }
    if sharded_world_size is not None:
        manifest.update(sharded=True, world_size=sharded_world_size)
    if sequence is not None:
        manifest[SEQUENCE] = sequence
    if resumed is not None:
        manifest[RESUMED] = {"step": resumed[0], "sequence": resumed[1]}
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def verify(path: Path, share: tuple[int, int] | None = None) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; CheckpointError naming what is wrong.

    ``share=(rank, world_size)``: of a sharded checkpoint, check only this rank's share of the
    files (those its ``rank`` wrote, modulo ``world_size``; rank 0 also the files without one),
    so that the ranks verify it together; they must then agree on the outcome. Every file of
    a checkpoint that is not sharded is checked either way.
    """
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a trainfsm checkpoint: it has no {MANIFEST} (trainfsm writes that file into the "
            f"directory before the directory gets its step's name, so this one was written by something else)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({exc})") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found not in READS or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(
            f"{manifest_path} has unknown format {found!r} (this trainfsm reads formats {', '.join(map(str, READS))})"
        )
    parsed = parse_step(path.name)
    if parsed is not None and manifest.get("step") != parsed[0]:
        raise CheckpointError(
            f"{manifest_path} describes step {manifest.get('step')!r}, not {parsed[0]} (a manifest from "
            f"another checkpoint?)"
        )
    checksum = manifest.get("checksum", "sha256") if found >= 4 else "sha256"
    if checksum not in CHECKSUMS:
        raise CheckpointError(
            f"{manifest_path} names checksum {checksum!r}; this trainfsm verifies {', '.join(CHECKSUMS)}"
        )
    listed: dict[str, Any] = manifest["files"]
    if share is not None and manifest.get("sharded"):
        rank, world = share
        listed = {n: e for n, e in listed.items() if _owner(e, world) == rank}
    for name, expected in listed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(f"{file} has {size} bytes, the manifest says {expected.get('bytes')} (truncated?)")
        if not _matches(file, expected, checksum):
            raise CheckpointError(f"{file} does not match its {checksum} in {MANIFEST} (corrupted)")
    return manifest  # type: ignore[no-any-return]


def written_whole(path: Path, step: int) -> dict[str, Any] | None:
    """The manifest of directory ``path`` where it describes ``step`` and every file it lists is
    there at its size, else None: a save's temporary directory that lacks only its rename.

    Sizes, not checksums: a save writes the manifest after every file is durable, so a manifest
    that parses stands for complete files; reading every byte of a large checkpoint to promote it
    would hold RESTORE for minutes, and loading verifies the checksums anyway.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest["step"] != step or manifest.get("format") not in READS:
            return None
        for name, entry in manifest["files"].items():
            if (path / name).stat().st_size != entry["bytes"]:
                return None
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return None
    return manifest  # type: ignore[no-any-return]


def load(path: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Verify (unless given the ``manifest`` ``verify`` returned), then load every ``.pt`` file
    with ``weights_only=True``: file stem -> object. Of a sharded checkpoint, that is
    ``training_state`` and ``hooks``: its model and optimizer are read with DCP (the hook does)."""
    if manifest is None:
        manifest = verify(path)
    parts = {}
    for name in manifest["files"]:
        if "/" in name or not name.endswith(".pt"):
            continue  # a shard of a sharded checkpoint
        parts[name.removesuffix(".pt")] = load_file(path / name)
    return parts


def load_file(file: Path) -> Any:
    """One ``.pt`` file, loaded with ``weights_only=True`` onto the CPU; CheckpointError if it cannot be."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses arbitrary pickles: say so, run nothing
        raise CheckpointError(
            f"{file} could not be loaded safely with weights_only=True ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it holds objects other than tensors and "
            f"plain containers, or is not a torch file"
        ) from None


def _matches(file: Path, expected: dict[str, Any], checksum: str) -> bool:
    """Whether ``file`` has the sum(s) its manifest entry lists."""
    if "digest" in expected:
        return file_sums(file, checksum) == [expected["digest"]]
    sums = expected.get("chunks", expected.get("sha256_chunks"))
    if sums is not None:
        chunk = expected.get("chunk_bytes")
        return isinstance(chunk, int) and chunk > 0 and file_sums(file, checksum, chunk) == sums
    return file_sums(file, "sha256") == [expected.get("sha256")]


def _owner(entry: dict[str, Any], world: int) -> int:
    """The rank that verifies a file of a sharded checkpoint: the one that wrote it, modulo the
    world size that reads it; rank 0 for files rank 0 wrote alone (training_state.pt, hooks.pt)."""
    rank = entry.get("rank", 0)
    return rank % world if isinstance(rank, int) and rank >= 0 else 0
