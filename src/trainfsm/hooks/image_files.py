"""``ImageFileLoggerHook``: the images given to ``trainer.log_images`` as files on rank 0.

Layout: ``workspace/visualizations/<step>/<key>.<format>``. A nested dict becomes subdirectories,
and so does a ``/`` inside a key: ``trainer.log_images({"val": {"sample": image}})`` at step 20
writes ``visualizations/20/val/sample.png``, exactly as ``{"val/sample": image}`` would.

Also home of the two helpers the wandb and TensorBoard hooks share: ``flatten`` (nested keys joined
with ``/``) and ``to_pil`` (PIL images, tensors and arrays to a PIL image, by one set of rules).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainfsm.hooks.base import BaseHook

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from trainfsm.trainer import BaseTrainer

#: Extension -> PIL's format name, for the formats ImageFileLoggerHook writes.
FILE_FORMATS: dict[str, str] = {
    "png": "PNG",
    "jpg": "JPEG",
    "jpeg": "JPEG",
    "bmp": "BMP",
    "gif": "GIF",
    "tif": "TIFF",
    "tiff": "TIFF",
    "webp": "WEBP",
}
_CHANNELS = (1, 3, 4)  # grayscale, RGB, RGBA


def optional_import(module: str, extra: str, purpose: str, package: str | None = None) -> Any:
    """Import an optional dependency where it is used, naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{purpose} needs the {package or module.split('.')[0]!r} package, which is not installed: "
            f"pip install 'trainfsm[{extra}]' ({exc})"
        ) from exc


def flatten(records: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(key, leaf)`` pairs of a nested dict, nested keys joined with ``/``: ``{"a": {"b": 1}}``
    gives ``("a/b", 1)``."""
    for path, value in flatten_paths(records, (prefix,) if prefix else ()):
        yield "/".join(path), value


def flatten_paths(records: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, leaf)`` pairs of a nested dict: ``{"a": {"b": 1}}`` gives ``(("a", "b"), 1)``."""
    for key, value in records.items():
        if not isinstance(key, str):
            raise TypeError(f"logged record keys must be str; got {key!r} ({type(key).__name__}) in {records!r}.")
        path = (*prefix, key)
        if isinstance(value, Mapping):
            yield from flatten_paths(value, path)
        else:
            yield path, value


def check_image_format(
    owner: str, value: Any, allowed: Mapping[str, Any] | tuple[str, ...], allow_none: bool = False
) -> Any:
    """``image_format`` of ``owner``: one of ``allowed`` (case-insensitive), a callable, or None if allowed."""
    if (value is None and allow_none) or callable(value):
        return value
    allowed_text = ", ".join(repr(name) for name in allowed) + (", None" if allow_none else "")
    allowed_text += ", or a callable that takes the key and returns one"
    if not isinstance(value, str):
        raise TypeError(f"{owner} image_format must be one of {allowed_text}; got {value!r} ({type(value).__name__}).")
    if value.lower() not in allowed:
        raise ValueError(f"{owner} image_format must be one of {allowed_text}; got {value!r}.")
    return value.lower()


def resolve_format(
    owner: str, image_format: Any, key: str, allowed: Mapping[str, Any] | tuple[str, ...], default: str = "png"
) -> str:
    """The format for ``key``: ``image_format`` itself, or what the callable returns for the key."""
    fmt = image_format(key) if callable(image_format) else image_format
    if fmt is None:
        return default
    if not isinstance(fmt, str) or fmt.lower() not in allowed:
        names = ", ".join(repr(name) for name in allowed)
        raise ValueError(f"{owner} image_format({key!r}) returned {fmt!r}; it must return one of {names}.")
    return fmt.lower()


def to_pil(value: Any, key: str) -> PILImage.Image:
    """A PIL image from a PIL image (returned as is), a torch tensor or a numpy array.

    Tensors and arrays are ``(H, W)`` or 3-D with 1, 3 or 4 channels, channels first ``(C, H, W)``
    or last ``(H, W, C)``: the dimension of size 1, 3 or 4 is the channel one. When both ends could
    be (a 3x4x3 image), a tensor is read as CHW (torch's convention), an array as HWC (numpy's and
    PIL's). ``uint8`` values are kept; floating values are taken to be in [0, 1], clamped, scaled by
    255 and rounded. Converting a tensor or an array needs numpy.
    """
    image_module = optional_import("PIL.Image", "images", "Logging images", package="pillow")
    if isinstance(value, image_module.Image):
        return value  # type: ignore[no-any-return]
    numpy = sys.modules.get("numpy")  # an ndarray exists only if numpy was imported
    if isinstance(value, torch.Tensor):
        channels_first = True
        tensor = value.detach()
    elif numpy is not None and isinstance(value, numpy.ndarray):
        channels_first = False
        tensor = torch.from_numpy(numpy.ascontiguousarray(value))
    else:
        raise TypeError(
            f"log_images: {key!r} must be a PIL image, a torch tensor or a numpy array; got {type(value).__name__}."
        )
    optional_import("numpy", "images", "Logging a tensor as an image")
    if tensor.dim() == 3:
        first, last = tensor.shape[0] in _CHANNELS, tensor.shape[-1] in _CHANNELS
        if first and (channels_first or not last):
            tensor = tensor.permute(1, 2, 0)
        elif not last:
            raise ValueError(
                f"log_images: {key!r} has shape {tuple(tensor.shape)}; a 3-D image needs 1, 3 or 4 channels, "
                f"first (C, H, W) or last (H, W, C)."
            )
        if tensor.shape[-1] == 1:
            tensor = tensor[..., 0]
    elif tensor.dim() != 2:
        raise ValueError(
            f"log_images: {key!r} has shape {tuple(tensor.shape)}; an image is (H, W), (C, H, W) or (H, W, C)."
        )
    if tensor.is_floating_point():
        tensor = (tensor.float().clamp(0, 1) * 255).round().to(torch.uint8)
    elif tensor.dtype != torch.uint8:
        raise TypeError(
            f"log_images: {key!r} has dtype {tensor.dtype}; images must be uint8 (0-255) or floating (0-1)."
        )
    # A host copy (and a sync for a GPU tensor): images are logged at intervals, off the step path.
    return image_module.fromarray(tensor.cpu().contiguous().numpy())  # type: ignore[no-any-return]


def save_image(image: PILImage.Image, path: Path, fmt: str) -> None:
    """Write ``image`` to ``path`` atomically (a killed process leaves no torn file)."""
    pil_format = FILE_FORMATS[fmt]
    if pil_format == "JPEG" and image.mode not in ("L", "RGB", "CMYK"):
        image = image.convert("RGB")  # JPEG has no alpha channel
    tmp = path.with_name(f".{path.name}.tmp")
    image.save(tmp, format=pil_format)
    os.replace(tmp, path)


class ImageFileLoggerHook(BaseHook):
    """Write what ``trainer.log_images`` receives to ``workspace/visualizations/<step>/<key>.<format>``
    on rank 0. A nested dict, like a ``/`` in a key, becomes subdirectories: ``{"val": {"sample":
    image}}`` at step 20 is ``visualizations/20/val/sample.png``. Values are PIL images, torch
    tensors or numpy arrays (see ``to_pil``). A step logged again (a resumed run) overwrites its
    files.

    Arguments:

    - ``image_format`` (default ``"png"``): a file extension (``"png"``, ``"jpg"``, ``"jpeg"``,
      ``"bmp"``, ``"gif"``, ``"tif"``, ``"tiff"``, ``"webp"``) or a callable that takes the
      ``/``-joined key and returns one.
    """

    def __init__(self, image_format: str | Callable[[str], str] = "png") -> None:
        self.image_format = check_image_format("ImageFileLoggerHook", image_format, FILE_FORMATS)

    def on_before_train(self, trainer: BaseTrainer) -> None:
        if trainer.rank == 0:
            self._root(trainer)  # no workspace: say so before the first step, not at the first image

    def on_log_images(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        if dry_run or trainer.rank != 0:
            return
        root = self._root(trainer) / str(trainer.step)
        for key, value in flatten(records):
            parts = key.split("/")
            if any(part in ("", ".", "..") or os.sep in part for part in parts):
                raise ValueError(
                    f"ImageFileLoggerHook: key {key!r} does not make a file path under {root}; use non-empty "
                    f"key parts other than '.' and '..'."
                )
            fmt = resolve_format("ImageFileLoggerHook", self.image_format, key, FILE_FORMATS)
            path = root.joinpath(*parts[:-1], f"{parts[-1]}.{fmt}")
            image = to_pil(value, key)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_image(image, path, fmt)

    @staticmethod
    def _root(trainer: BaseTrainer) -> Path:
        if trainer.workspace is None:
            raise ValueError(
                "ImageFileLoggerHook writes under workspace/visualizations; give the trainer a workspace "
                "(BaseTrainer(workspace=...))."
            )
        return trainer.workspace / "visualizations"
