"""``TensorBoardHook``: what ``trainer.log`` / ``trainer.log_images`` receive, as TensorBoard scalars
and images on rank 0, at the trainer's step.

A resumed run does not duplicate steps: when the log directory already holds event files, the
writer opens with ``purge_step=trainer.step + 1``. TensorBoard then drops, from the earlier files,
every event at that step or later, which are the steps a killed or preempted attempt logged after
the checkpoint the run resumed from; the resumed attempt logs them again.
"""

from __future__ import annotations

import importlib
import numbers
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainfsm.hooks.base import BaseHook
from trainfsm.hooks.image_files import flatten_paths, optional_import, to_pil

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer


class TensorBoardHook(BaseHook):
    """Write ``trainer.log`` records as scalars and ``trainer.log_images`` as images, rank 0 only.
    The writer is flushed and closed at EXIT, whatever the exit reason.

    Nested keys become the tag, as in ``trainloop``: ``{"val": {"loss": x}}`` is ``val/loss``. Scalars
    are numbers and one-element tensors; any other value is skipped with a warning (once per key).
    Images: PIL images, tensors or numpy arrays (see ``trainfsm.hooks.image_files.to_pil``).

    Arguments:

    - ``log_dir`` (default None: ``workspace/tensorboard``): a relative path is taken under the
      workspace (or the working directory without one).
    - ``flush_secs`` (default 120) and ``max_queue`` (default 10): passed to the ``SummaryWriter``.
    - ``namespace_separator`` (default ``"/"``): joins the namespace's parts before the last ``/``
      and the leaf: ``{"a": {"b": {"c": x}}}`` is ``a/b/c``, or ``a.b/c`` with ``"."`` (TensorBoard
      groups charts by the part before the last ``/``).
    - ``texts`` (default None): a dict written once as text summaries when training starts (a
      config, a command line).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        flush_secs: float = 120,
        max_queue: int = 10,
        namespace_separator: str = "/",
        texts: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(namespace_separator, str) or not namespace_separator:
            raise ValueError(
                f"TensorBoardHook namespace_separator must be a non-empty str; got {namespace_separator!r}."
            )
        self.namespace_separator = namespace_separator
        if texts is not None and not isinstance(texts, Mapping):
            raise TypeError(f"TensorBoardHook texts must be a dict of name -> text, or None; got {texts!r}.")
        self.texts = dict(texts or {})
        if log_dir is not None and (not isinstance(log_dir, (str, os.PathLike)) or str(log_dir) == ""):
            raise TypeError(f"TensorBoardHook log_dir must be a non-empty str or path, or None; got {log_dir!r}.")
        self.log_dir = None if log_dir is None else Path(log_dir)
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs > 0:
            raise ValueError(f"TensorBoardHook flush_secs must be a number of seconds > 0; got {flush_secs!r}.")
        self.flush_secs = flush_secs
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"TensorBoardHook max_queue must be an int >= 1; got {max_queue!r}.")
        self.max_queue = max_queue
        self.writer: Any = None  # the SummaryWriter, between on_before_train and on_after_train
        self._skipped: set[str] = set()
        self._closed = False

    def on_before_train(self, trainer: BaseTrainer) -> None:
        if trainer.rank != 0:
            return
        writer = self.writer if self.writer is not None else self._open(trainer)
        if self.texts:
            for name, text in self.texts.items():
                writer.add_text(str(name), str(text), global_step=trainer.step)
            writer.flush()

    def _tag(self, path: tuple[str, ...]) -> str:
        if len(path) == 1:
            return path[0]
        return self.namespace_separator.join(path[:-1]) + "/" + path[-1]

    def _open(self, trainer: BaseTrainer) -> Any:
        optional_import("tensorboard", "tensorboard", "TensorBoardHook")
        summary_writer = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        log_dir = self.resolved_log_dir(trainer)
        resumed = log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))
        purge_step = trainer.step + 1 if resumed else None
        self.writer = summary_writer(
            log_dir=str(log_dir), purge_step=purge_step, max_queue=self.max_queue, flush_secs=self.flush_secs
        )
        return self.writer

    def resolved_log_dir(self, trainer: BaseTrainer) -> Path:
        """Where the event files go for ``trainer``."""
        workspace = trainer.workspace
        if self.log_dir is None:
            if workspace is None:
                raise ValueError(
                    "TensorBoardHook needs a log_dir, or a trainer workspace to write workspace/tensorboard in."
                )
            return workspace / "tensorboard"
        if workspace is not None and not self.log_dir.is_absolute():
            return workspace / self.log_dir
        return self.log_dir

    def on_after_train(self, trainer: BaseTrainer) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            self._closed = True
            writer.close()  # flushes: a preempted run keeps every row it logged

    def on_log(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        writer = self._active(trainer, dry_run)
        if writer is None:
            return
        for path, value in flatten_paths(records):
            key = self._tag(path)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                # A host sync for a GPU tensor: records are logged at intervals, not every micro-batch.
                value = value.item()
            if isinstance(value, numbers.Real):
                writer.add_scalar(key, value, global_step=trainer.step)
            elif key not in self._skipped:
                self._skipped.add(key)
                warnings.warn(
                    f"TensorBoardHook logs numbers as scalars; {key!r} is a {type(value).__name__} and is skipped.",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def on_log_images(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        writer = self._active(trainer, dry_run)
        if writer is None:
            return
        numpy = optional_import("numpy", "tensorboard", "TensorBoardHook images")
        for path, value in flatten_paths(records):
            key = self._tag(path)
            image = to_pil(value, key)
            if image.mode not in ("L", "RGB", "RGBA"):
                image = image.convert("RGB")
            array = numpy.asarray(image)
            writer.add_image(key, array, global_step=trainer.step, dataformats="HW" if array.ndim == 2 else "HWC")

    def _active(self, trainer: BaseTrainer, dry_run: bool) -> Any:
        if dry_run or trainer.rank != 0:
            return None
        if self.writer is not None:
            return self.writer
        if self._closed:
            warnings.warn(
                "TensorBoardHook: the writer was closed at EXIT; records logged after train() are dropped.",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return self._open(trainer)  # logged before on_before_train (e.g. from RESTORE)
