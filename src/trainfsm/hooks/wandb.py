"""``WandbHook``: what ``trainer.log`` / ``trainer.log_images`` receive, logged to a Weights & Biases
run on rank 0 at the trainer's step.

The run starts in ``on_before_train`` (after RESTORE: a resumed trainer knows its step) and is
finished in ``on_after_train``, on every way out of the machine: exit code 0 when the run completed
or was stopped, the trainer's exit code otherwise (1 failed, 128+signal preempted; a preempted run is
also marked preempting first). Finishing matters: wandb holds the last row until the step moves on or
the run finishes, and a process that exits without finishing loses it. EXIT then waits, with
``wandb.teardown()``, until wandb's service process has written or sent everything: ``finish()``
alone returns before that. (So a wandb run of your own that is still open at EXIT is finished too.)

Every row is logged with ``step=trainer.step``: wandb merges a ``log()`` without ``step`` into the
previous explicit step, so mixing the two would file values under the wrong step.

The run id is kept in ``workspace/wandb/run_id``; a later launch in the same workspace (a resumed or
requeued job) continues that run (``resume="allow"``). Precedence for the id: ``id=`` given to the
hook, then ``WANDB_RUN_ID``, then the stored id, then a new one from wandb. wandb's own files go to
``dir=`` if given, else ``WANDB_DIR``, else the workspace. Nothing else is forced: ``WANDB_MODE``,
``WANDB_PROJECT``, ``WANDB_RESUME`` and the other ``WANDB_*`` variables keep their meaning.

A known limit: steps a killed attempt logged after its last checkpoint are logged again by the
resumed attempt; the wandb server keeps the first values and ignores rows whose step is lower than
the run's latest step (offline runs upload the same way).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainfsm.hooks.base import BaseHook
from trainfsm.hooks.image_files import check_image_format, flatten, optional_import, resolve_format, to_pil
from trainfsm.machine import ExitReason

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

#: The formats ``wandb.Image`` writes.
WANDB_IMAGE_FORMATS = ("png", "jpg", "jpeg", "bmp")
#: Where the run id is kept, under the trainer's workspace.
RUN_ID_FILE = Path("wandb") / "run_id"


class WandbHook(BaseHook):
    """Log ``trainer.log`` / ``trainer.log_images`` to wandb on rank 0, each row at ``trainer.step``.

    The run starts after RESTORE and is finished at EXIT however the run ends; its id is kept in
    ``workspace/wandb/run_id``, so a resumed or requeued launch continues the same wandb run (the
    module's docstring has the details: id precedence, ``WANDB_*`` variables, known limits).
    Records: nested keys are joined with ``/`` (``{"val": {"loss": x}}`` is ``val/loss``); one-element
    tensors become numbers. Images: PIL images, tensors, numpy arrays (see
    ``trainfsm.hooks.image_files.to_pil``), ``wandb.Image`` objects, or lists of these.

    Arguments:

    - ``project`` (required; None leaves it to wandb and ``WANDB_PROJECT``), ``name`` (default None),
      ``tags`` (default None): as ``wandb.init``'s.
    - ``config`` (default None): a dict, or the path of a JSON file holding one.
    - ``image_format`` (default ``"png"``): ``"png"``, ``"jpg"``, ``"jpeg"``, ``"bmp"``, None (wandb's
      default, png), or a callable that takes the ``/``-joined key and returns one of these.
    - ``**wandb_kwargs``: passed to ``wandb.init`` as they are (``entity``, ``group``, ``mode``,
      ``settings``, ``id``, ``resume``, ...).
    """

    def __init__(
        self,
        project: str | None,
        name: str | None = None,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        tags: Sequence[str] | None = None,
        image_format: str | Callable[[str], str | None] | None = "png",
        **wandb_kwargs: Any,
    ) -> None:
        self.project = _optional_str("project", project)
        self.name = _optional_str("name", name)
        self.config = _load_config(config)
        if tags is not None and (isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags)):
            raise TypeError(f"WandbHook tags must be a list of str or None; got {tags!r}.")
        self.tags = None if tags is None else list(tags)
        self.image_format = check_image_format("WandbHook", image_format, WANDB_IMAGE_FORMATS, allow_none=True)
        if "id" in wandb_kwargs:
            _optional_str("id", wandb_kwargs["id"])
        self.wandb_kwargs = wandb_kwargs
        self.run: Any = None  # the wandb Run, between on_before_train and on_after_train
        self._finished = False

    # ------------------------------------------------------------------ the run's life
    def on_before_train(self, trainer: BaseTrainer) -> None:
        if trainer.rank == 0:
            self._start(trainer)

    def _start(self, trainer: BaseTrainer) -> Any:
        wandb = optional_import("wandb", "wandb", "WandbHook")
        kwargs: dict[str, Any] = {
            key: value
            for key, value in (("project", self.project), ("name", self.name), ("tags", self.tags))
            if value is not None
        }
        if self.config is not None:
            kwargs["config"] = dict(self.config)
        kwargs.update(self.wandb_kwargs)
        workspace = trainer.workspace
        id_file = workspace / RUN_ID_FILE if workspace is not None else None
        stored = _read_id(id_file)
        if stored and "id" not in kwargs and not os.environ.get("WANDB_RUN_ID"):
            kwargs["id"] = stored
        if "resume" not in kwargs and not os.environ.get("WANDB_RESUME"):
            kwargs["resume"] = "allow"  # the stored id's run if it exists, a new one otherwise
        if workspace is not None and "dir" not in kwargs and not os.environ.get("WANDB_DIR"):
            workspace.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(workspace)
        self.run = run = wandb.init(**kwargs)
        self._finished = False
        if id_file is not None and not run.disabled and run.id != stored:
            _write_id(id_file, run.id)
        trainer.events.info("wandb_run", wandb_id=run.id, continued=run.id == stored, mode=run.settings.mode)
        return run

    def on_after_train(self, trainer: BaseTrainer) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        self._finished = True
        code = trainer.exit_code if trainer.exit_code is not None else 1
        try:
            if trainer.exit_reason is ExitReason.PREEMPTED:
                run.mark_preempting()
            run.finish(exit_code=code)
        finally:
            # finish() returns before wandb's service process has written (offline) or sent the
            # run's last records; teardown waits for it. The process may be signalled right after
            # EXIT (SLURM sends SIGTERM to every process of a job just after a requeue), and a
            # service killed with unwritten records loses them (measured with wandb 0.31).
            optional_import("wandb", "wandb", "WandbHook").teardown()

    # ------------------------------------------------------------------ logging
    def on_log(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        run = self._active(trainer, dry_run)
        if run is not None:
            run.log({key: _scalar(value) for key, value in flatten(records)}, step=trainer.step)

    def on_log_images(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        run = self._active(trainer, dry_run)
        if run is None:
            return
        wandb = optional_import("wandb", "wandb", "WandbHook")
        row = {key: self._image(wandb, key, value) for key, value in flatten(records)}
        run.log(row, step=trainer.step)

    def _active(self, trainer: BaseTrainer, dry_run: bool) -> Any:
        if dry_run or trainer.rank != 0:
            return None
        if self.run is None:
            if self._finished:
                warnings.warn(
                    "WandbHook: the wandb run was finished at EXIT; records logged after train() are dropped.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return None
            return self._start(trainer)  # logged before on_before_train (e.g. from RESTORE)
        return self.run

    def _image(self, wandb: Any, key: str, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [self._image(wandb, key, item) for item in value]
        if isinstance(value, wandb.Image):
            return value
        fmt = resolve_format("WandbHook", self.image_format, key, WANDB_IMAGE_FORMATS)
        image = to_pil(value, key)
        if fmt in ("jpg", "jpeg") and image.mode not in ("L", "RGB"):
            image = image.convert("RGB")  # JPEG has no alpha channel
        return wandb.Image(image, file_type=fmt)


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        # A host sync for a GPU tensor: records are logged at intervals, not every micro-batch.
        return value.item()
    return value


def _optional_str(argument: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"WandbHook {argument} must be a non-empty str or None; got {value!r}.")
    return value


def _load_config(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"WandbHook config must be a dict, the path of a JSON file, or None; got {config!r} "
            f"({type(config).__name__})."
        )
    path = Path(config)
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"WandbHook config: cannot read the JSON file {str(path)!r} ({exc}).") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"WandbHook config: {str(path)!r} is not valid JSON ({exc}).") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"WandbHook config: {str(path)!r} must hold a JSON object; it holds {type(loaded).__name__}.")
    return loaded


def _read_id(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _write_id(path: Path, run_id: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
