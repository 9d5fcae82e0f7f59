"""Sharded checkpoints: each rank writes and reads its own part with ``torch.distributed.checkpoint``.

``CheckpointingHook(sharded=...)`` uses these pieces; ``CheckpointStore`` still makes the save atomic
as a whole (one temporary directory, the manifest last, a rename, ``latest``). Inside a checkpoint::

    1000/  training_state.pt  [hooks.pt]  manifest.json            (rank 0)
           sharded/.metadata                                        (rank 0: DCP's keys, shapes, where)
           sharded/__0_0.distcp  sharded/__1_0.distcp  ...          (each rank its own shards)

Every rank must see the same directory: sharded checkpoints need a filesystem shared by all ranks.

DCP itself trusts what it reads: it unpickles ``.metadata`` with ``pickle.load`` and the
non-tensor entries (the optimizer's param groups) with ``torch.load(weights_only=False)``.
``SafeReader`` and ``SafeLoadPlanner`` read both without running code from the file, so the
store's promise (nothing is unpickled that could run code, and only after the manifest's sums
matched) holds for sharded checkpoints too.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from trainfsm.checkpoint.store import CheckpointError

SUBDIR: Final = "sharded"
METADATA: Final = ".metadata"
#: DCP's flattened keys start with the state dict's top-level name: "model.0.weight", "optimizer.state...".
MODEL_PREFIX: Final = "model."


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor split over ranks (FSDP2 ``fully_shard``, tensor parallel)."""
    placements = getattr(tensor, "placements", None)
    return placements is not None and not all(p.is_replicate() for p in placements)


def holds_sharded(state: dict[str, Any]) -> bool:
    return any(is_sharded(value) for value in state.values())


def sharded_view(options: Any) -> Any:
    """The trainer's ``state_dict_options`` as DCP wants them: each rank's shards, where they live."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return replace(options or StateDictOptions(), full_state_dict=False, cpu_offload=False)


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_without_process_group() -> Iterator[None]:
    """One process without a process group is a deliberate use here: DCP's warning that it assumes
    so (on every save and load) is silenced, and only it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is .*assuming the intent is to", category=UserWarning
        )
        yield


class _RecordingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that remembers which files this rank wrote (for the manifest)."""

    def __init__(self, path: Path) -> None:
        # sync_files: each file is fsynced before DCP reports it written.
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        # DCP's file writer is synchronous: the results are there when write_data returns.
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future


def save(state: dict[str, Any], directory: Path, rank: int, group: Any = None) -> list[str]:
    """Write this rank's part of ``state`` into ``directory`` (collective over ``group``, None: the
    default group); the files written, relative to ``directory``, sorted (rank 0's include
    ``.metadata``). A failure on any rank raises on all."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    writer = _RecordingWriter(directory)
    try:
        with _quiet_without_process_group():
            dcp_save(state, storage_writer=writer, process_group=group, no_dist=_no_dist())
    except Exception as exc:  # DCP gathers every rank's failure and raises the same on each
        raise CheckpointError(f"sharded save into {directory} failed: {_describe(exc)}") from exc
    return [*([METADATA] if rank == 0 else []), *writer.written]


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that reads ``.metadata`` with an unpickler limited to DCP's own types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries must load with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)  # refuses anything but plain data; runs nothing
        except Exception as exc:
            raise CheckpointError(
                f"sharded checkpoint entry {read_item.dest_index.fqn!r} could not be loaded safely with "
                f"weights_only=True ({type(exc).__name__}: {_first_line(exc)})"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)  # known to be plain data now


def load(state: dict[str, Any], directory: Path) -> None:
    """Read ``directory`` into ``state`` in place (collective): each rank reads what its shards need,
    whatever the world size that saved it (DCP reshards)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    try:
        with _quiet_without_process_group():
            dcp_load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner(), no_dist=_no_dist())
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"sharded checkpoint {directory} could not be loaded: {_describe(exc)}") from exc


#: What a DCP ``.metadata`` pickle may name: DCP's metadata classes, torch.Size and dtypes, paths.
_ALLOWED_MODULES: Final = ("torch.distributed.checkpoint.metadata",)
_ALLOWED: Final = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module.startswith(("torch", "pathlib", "collections")) else None
        allowed = (
            (module, name) in _ALLOWED
            or (module in _ALLOWED_MODULES and isinstance(found, type))
            or (module == "torch" and isinstance(found, torch.dtype))
        )
        if not allowed:
            raise CheckpointError(
                f"DCP metadata refers to {module}.{name}, which DCP metadata never holds; not loaded (it could "
                f"run code)"
            )
        return found


def read_metadata(directory: Path) -> Any:
    """DCP's ``Metadata`` of ``directory`` (keys, global shapes, which file holds what), read safely."""
    path = directory / METADATA
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path} is not DCP metadata ({type(exc).__name__}: {_first_line(exc)})") from None


def saved_shapes(metadata: Any, prefix: str = MODEL_PREFIX) -> dict[str, torch.Size | None]:
    """Key (without ``prefix``) -> global shape of each entry under ``prefix``; None for non-tensors."""
    shapes: dict[str, torch.Size | None] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            size = getattr(entry, "size", None)
            shapes[key[len(prefix) :]] = torch.Size(size) if size is not None else None
    return shapes


def _describe(exc: Any) -> str:
    """``Type: first line``; for DCP's CheckpointException, that of each rank's failure."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {_describe(getattr(failure, 'exc', failure))}" for rank, failure in sorted(failures.items())
        )
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
