"""``trainfsm inspect``: verify a checkpoint and say what is inside it.

Verification is ``CheckpointStore.verify``: the manifest's format, the files it lists, their sizes
and checksums (with the algorithm the manifest names). Only then are the files opened, with
``torch.load(weights_only=True)`` (no pickle can run code) and ``mmap=True`` (a large checkpoint
is paged in as it is looked at, not read whole into memory).

A sharded checkpoint (written with torch.distributed.checkpoint) needs no process group here:
its files are verified the same way, and DCP's ``.metadata`` (read with an unpickler that allows
only DCP's own types) gives each entry's key, global shape and dtype; the shards are not read.

A checkpoint that trainloop wrote (``trainfsm.checkpoint.trainloop``: its files, no manifest) has
nothing to verify: it records no sizes or checksums. Its files are loaded the same safe way and
listed, with what trainfsm resumes from it and what it lacks (random state, data position), and it
fails where a resume would: a ``training_state.pt`` that is not trainloop's.

The path may name a checkpoint directory (``checkpoints/1000``), a store (``checkpoints``: its
``latest``) or a workspace (``WORKSPACE/checkpoints/latest``).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from trainfsm.checkpoint import trainloop
from trainfsm.checkpoint.store import (
    LATEST,
    MANIFEST,
    TRAINFSM,
    TRAINLOOP,
    CheckpointError,
    CheckpointStore,
    parse_step,
)

#: ``training_state.pt`` keys shown as plain values.
_SCALARS: Final = ("step", "epoch")


class CheckpointNotFound(Exception):
    """No checkpoint at the given path (the command exits 2, as for any unreadable input)."""


@dataclass(slots=True)
class Inspection:
    path: Path
    resolved_from: str | None  # how ``path`` was found from what was given, if not given directly
    manifest: dict[str, Any]
    parts: dict[str, Any]  # file stem -> loaded object (the .pt files)
    sharded: dict[str, Any] | None = None  # DCP key -> TensorStorageMetadata / BytesStorageMetadata
    written_by: str = TRAINFSM  # or TRAINLOOP: no manifest (empty), nothing verified


def resolve(given: Path) -> tuple[Path, str | None]:
    """The checkpoint directory that ``given`` names, and how it was found from ``given``."""
    if not given.is_dir():
        raise CheckpointNotFound(f"{given}: no such directory")
    if (given / MANIFEST).is_file() or parse_step(given.name) is not None:
        return given, None  # a checkpoint, complete or not: verify says which
    for root, how in ((given, LATEST), (given / "checkpoints", f"checkpoints/{LATEST}")):
        name = CheckpointStore(root).latest_name()
        if name is not None:
            return root / name, f"{given}: {how}"
    raise CheckpointNotFound(
        f"{given}: not a checkpoint (no {MANIFEST}), nor a checkpoint store or workspace with a {LATEST} pointer"
    )


def inspect(given: Path) -> Inspection:
    """Verify and load the checkpoint ``given`` names; ``CheckpointError`` when it is not intact."""
    path, how = resolve(given)
    found = _inspect_trainloop(path, how) if trainloop.is_trainloop(path) else None
    if found is not None:
        return found
    manifest = CheckpointStore.verify(path)
    parts = {name.removesuffix(".pt"): _load(path / name) for name in manifest["files"] if "/" not in name}
    entries = None
    if manifest.get("sharded"):
        from trainfsm.checkpoint import sharded

        entries = dict(sharded.read_metadata(path / sharded.SUBDIR).state_dict_metadata)
    return Inspection(path, how, manifest, parts, entries)


def _inspect_trainloop(path: Path, how: str | None) -> Inspection | None:
    """Load a trainloop checkpoint's files (no manifest: nothing to verify first), and check its
    training state as a resume would (``trainloop.check_training_state``). None for a trainfsm
    checkpoint that lost its manifest (its training state has ``ranks``): ``verify`` says what is wrong."""
    training = _load(path / "training_state.pt")
    if isinstance(training, dict) and "ranks" in training:
        return None
    trainloop.check_training_state(path, training)
    parts = {file.stem: _load(file) for file in sorted(path.glob("*.pt")) if file.is_file()}
    return Inspection(path, how, {}, parts, written_by=TRAINLOOP)


def _load(file: Path) -> Any:
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # verified bytes that still do not load: say so, run nothing
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(
            f"{file} could not be loaded safely with weights_only=True ({type(exc).__name__}: {first})"
        ) from None


# -------------------------------------------------------------------- rendering
def _algorithm(manifest: dict[str, Any]) -> str:
    """The checksum a manifest names (formats 4 and 5); formats 1-3 are sha256."""
    return str(manifest.get("checksum", "sha256"))


def _sums(info: dict[str, Any], algorithm: str) -> str:
    """Format 5 has one sum per file, formats 2-4 one per chunk, format 1 one sha256 per file."""
    if "digest" in info:
        return f"{algorithm} {info['digest'][:16]}..."
    chunks = info.get("chunks", info.get("sha256_chunks"))
    if chunks is not None:
        return f"{algorithm} {chunks[0][:16]}... ({len(chunks)} x {_size(info['chunk_bytes'])} chunks)"
    return f"sha256 {info['sha256'][:16]}..."


def render(found: Inspection) -> str:
    if found.written_by == TRAINLOOP:
        return _render_trainloop(found)
    manifest, parts = found.manifest, found.parts
    lines = [f"checkpoint {found.path}" + (f"  (from {found.resolved_from})" if found.resolved_from else "")]
    files = manifest["files"]
    lines.append(
        f"verified: manifest format {manifest['format']}, {len(files)} files, sizes and "
        f"{_algorithm(manifest)} checksums match"
    )
    created = manifest.get("created")
    when = datetime.datetime.fromtimestamp(created).isoformat(sep=" ", timespec="seconds") if created else "?"
    versions = ", ".join(f"{k} {v}" for k, v in sorted((manifest.get("versions") or {}).items()))
    lines.append(f"step {manifest.get('step')}, kept: {'yes' if manifest.get('kept') else 'no'}, created {when}")
    lines.append(f"written by: {versions or '?'}")
    lines.append("")
    lines.append("files:")
    manifest_bytes = (found.path / MANIFEST).stat().st_size
    lines.append(f"  {MANIFEST:<22} {_size(manifest_bytes):>10}")
    lines.extend(
        f"  {name:<22} {_size(info['bytes']):>10}  {_sums(info, _algorithm(manifest))}"
        + (f"  rank {info['rank']}" if "rank" in info else "")
        for name, info in files.items()
    )
    if found.sharded is not None:
        lines.append("")
        lines.extend(_render_sharded(found.sharded, manifest.get("world_size")))
    model = parts.get("model", {}).get("model") if isinstance(parts.get("model"), dict) else None
    if isinstance(model, dict):
        lines.append("")
        lines.extend(_render_model(model))
    state = parts.get("training_state")
    if isinstance(state, dict):
        lines.append("")
        lines.extend(_render_training_state(state))
    hooks = parts.get("hooks")
    if isinstance(hooks, dict):
        lines.append("")
        lines.append(f"hooks (hooks.pt): {', '.join(hooks) or 'none'}")
        lines.extend(f"  {key}: {_describe(value)}" for key, value in hooks.items())
    return "\n".join(lines)


def _render_trainloop(found: Inspection) -> str:
    """A trainloop checkpoint: its files and what they hold; ``model.pt`` is the state dict itself,
    ``training_state.pt`` the step and optimizer, scheduler and scaler states, any other file a hook's."""
    parts, path = found.parts, found.path
    kept = parse_step(path.name)
    lines = [f"checkpoint {path}" + (f"  (from {found.resolved_from})" if found.resolved_from else "")]
    lines.append(
        f"written by trainloop (no {MANIFEST}): no sizes or checksums to verify; files loaded with weights_only=True"
    )
    step = parts["training_state"].get("step")
    lines.append(f"step {step}, kept: {'yes' if kept is not None and kept[1] else 'no'}")
    lines.append("")
    lines.append("files:")
    lines.extend(f"  {name + '.pt':<22} {_size((path / f'{name}.pt').stat().st_size):>10}" for name in parts)
    model = parts.get("model")
    if isinstance(model, dict):
        lines.append("")
        lines.extend(_render_model(model))
    lines.append("")
    lines.extend(_render_training_state(parts["training_state"], scalars=("step",)))
    lines.append("  not saved by trainloop: random state, data position (a resumed run starts a fresh data iterator)")
    hooks = {name: value for name, value in parts.items() if name not in ("model", "training_state")}
    lines.append("")
    lines.append(f"hooks: {', '.join(f'{name} ({name}.pt)' for name in hooks) or 'none'}")
    lines.extend(f"  {name}: {_describe(value)}" for name, value in hooks.items())
    return "\n".join(lines)


def _render_model(model: dict[str, Any]) -> list[str]:
    import torch

    tensors = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    count = sum(t.numel() for t in tensors.values())
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    lines = [f"model (model.pt): {len(model)} entries, {count:,} values, {_size(size)}"]
    width = max((len(name) for name in model), default=0)
    for name, value in model.items():
        if isinstance(value, torch.Tensor):
            shape = "(" + ", ".join(map(str, value.shape)) + ("," if value.dim() == 1 else "") + ")"
            lines.append(f"  {name:<{width}}  {shape:<16} {str(value.dtype).removeprefix('torch.')}")
        else:
            lines.append(f"  {name:<{width}}  {_describe(value)}")
    return lines


def _render_sharded(entries: dict[str, Any], world_size: Any) -> list[str]:
    """Model and optimizer of a sharded checkpoint, from DCP's metadata: global shapes, dtypes."""
    ranks = f"{world_size} rank{'' if world_size == 1 else 's'}"
    lines = [f"sharded (torch.distributed.checkpoint), written by {ranks}: model and optimizer"]
    model = {k.removeprefix("model."): v for k, v in entries.items() if k.startswith("model.")}
    tensors = {k: v for k, v in model.items() if getattr(v, "size", None) is not None}
    count = sum(math.prod(v.size) for v in tensors.values())
    size = sum(math.prod(v.size) * v.properties.dtype.itemsize for v in tensors.values())
    lines.append(f"model (sharded/): {len(model)} entries, {count:,} values, {_size(size)}")
    width = max((len(name) for name in model), default=0)
    for name, entry in model.items():
        lines.append(f"  {name:<{width}}  {_entry(entry)}")
    optimizer = [k for k in entries if k.startswith("optimizer.")]
    state_keys = sorted({k.rsplit(".", 1)[1] for k in optimizer if k.startswith("optimizer.state.")})
    lines.append(f"optimizer (sharded/): {len(optimizer)} entries; state {', '.join(state_keys) or 'empty'}")
    return lines


def _entry(entry: Any) -> str:
    size = getattr(entry, "size", None)
    if size is None:
        return "bytes"
    shape = "(" + ", ".join(map(str, size)) + ("," if len(size) == 1 else "") + ")"
    return f"{shape:<16} {str(entry.properties.dtype).removeprefix('torch.')}"


def _render_training_state(state: dict[str, Any], scalars: tuple[str, ...] = _SCALARS) -> list[str]:
    lines = ["training state (training_state.pt): " + ", ".join(f"{k} {state.get(k)}" for k in scalars)]
    if "optimizer" in state:  # a sharded checkpoint's optimizer is under sharded/
        lines.extend(_render_optimizer(state["optimizer"]))
    for key in ("lr_scheduler", "grad_scaler"):
        value = state.get(key)
        lines.append(f"  {key}: " + ("none" if not value else _keys(value)))
    ranks = state.get("ranks")
    if isinstance(ranks, list):
        inner = _keys(ranks[0]) if ranks and isinstance(ranks[0], dict) else ""
        lines.append(f"  ranks: {len(ranks)} ({inner})")
        lines.extend(_render_data(ranks))
    others = [k for k in state if k not in (*_SCALARS, "optimizer", "lr_scheduler", "grad_scaler", "ranks")]
    if others:
        lines.append(f"  other keys: {', '.join(others)}")
    return lines


def _render_data(ranks: list[Any]) -> list[str]:
    """Where the data stood: each rank's own position, and the global one that another number of
    ranks continues from (``trainfsm.data_order``)."""
    data: list[dict[str, Any]] = [entry["data"] for entry in ranks if isinstance((entry or {}).get("data"), dict)]
    if not data or len(data) != len(ranks):
        return ["  data: no position saved"]
    positions = sorted({(d["epoch"], d["batches"]) for d in data})
    own = ", ".join(f"epoch {e} micro-batch {b}" for e, b in positions)
    lines = [f"  data: {own} ({'every rank' if len(positions) == 1 else 'the ranks differ'})"]
    found, layout = data[0].get("global"), data[0].get("layout") or {}
    if found and len(positions) == 1:
        lines.append(
            f"    global: {found['samples']} samples into epoch {found['epoch']}'s order (DistributedSampler seed "
            f"{layout.get('seed')}, {layout.get('length')} samples, {len(ranks)} rank(s) x batch "
            f"{layout.get('batch_size')} x accumulation {layout.get('accumulation')}; an epoch trains "
            f"{layout.get('epoch_samples')}); W ranks of batch B continue there when W x B divides it"
        )
    else:
        why = layout.get("why") or "saved by a trainfsm before the global position"
        lines.append(f"    global: unknown ({why})")
    return lines


def _render_optimizer(optimizer: Any) -> list[str]:
    if not isinstance(optimizer, dict):
        return [f"  optimizer: {_describe(optimizer)}"]
    per_param = optimizer.get("state") or {}
    state_keys = sorted({key for entry in per_param.values() if isinstance(entry, dict) for key in entry})
    lines = [f"  optimizer: state for {len(per_param)} parameters ({', '.join(state_keys) or 'empty'})"]
    for index, group in enumerate(optimizer.get("param_groups") or []):
        settings = ", ".join(f"{k}={v}" for k, v in group.items() if k != "params")
        lines.append(f"    param group {index}: {len(group.get('params', []))} parameters; {settings}")
    return lines


def _keys(value: Any) -> str:
    return "keys " + ", ".join(map(str, value)) if isinstance(value, dict) else _describe(value)


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        return "{" + ", ".join(map(str, list(value)[:12])) + (", ..." if len(value) > 12 else "") + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover
