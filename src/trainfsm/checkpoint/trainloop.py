"""Checkpoints that ``trainloop`` wrote, read as they are: a user who switches the import in the
middle of a project resumes from them, and trainfsm never rewrites or deletes them.

trainloop's ``CheckpointingHook`` saves from rank 0 one ``torch.save`` file per top-level key of
its ``trainer.state_dict()`` into ``<path>/<step>/``, renamed into place from a temporary
``<step>.tmp.*`` directory (no manifest, no checksums, no fsync):

- ``model.pt``: the model's state dict itself (trainfsm's ``model.pt`` wraps it as ``{"model": ...}``);
- ``training_state.pt``: ``step``, ``optimizer``, ``lr_scheduler``, ``grad_scaler``;
- one file per hook state, named after its key (``ema.pt`` for ``EMAHook(name="ema")``).

A kept checkpoint is ``<step>_keep/`` with a ``<step>`` symlink to it, and ``latest`` is a symlink
to the newest step's name: the same names trainfsm uses, so the store lists them as it lists its own.

What such a checkpoint cannot give back: trainloop saves no random state and no data position. A
run resumed from one starts a fresh data iterator (the loader's first batches again, reshuffled
if it shuffles, as trainloop itself resumes) and draws random numbers from whatever the script
seeded; the model, optimizer, scheduler, scaler, hook states and step are exactly as saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from trainfsm.checkpoint.manifest import MANIFEST, CheckpointError, load_file

#: The files every trainloop checkpoint has.
FILES: Final = ("model.pt", "training_state.pt")
#: What ``training_state.pt`` must hold for a resume.
TRAINING_KEYS: Final = ("step", "optimizer")


def is_trainloop(path: Path) -> bool:
    """Whether ``path`` is a checkpoint directory trainloop wrote: its two files, no manifest of ours."""
    return path.is_dir() and not (path / MANIFEST).exists() and all((path / name).is_file() for name in FILES)


def load(path: Path) -> dict[str, Any]:
    """The state ``trainer.load_state_dict`` takes: ``model``, the training state's entries, and
    each hook's state under its file's stem. Every file is loaded with ``weights_only=True``."""
    parts = {file.stem: load_file(file) for file in sorted(path.iterdir()) if file.suffix == ".pt" and file.is_file()}
    training = parts.pop("training_state")
    check_training_state(path, training)
    return {**parts, **training}


def check_training_state(path: Path, training: Any) -> None:
    """CheckpointError unless ``training`` (``path``'s ``training_state.pt``) is trainloop's: a dict
    with ``TRAINING_KEYS``, and not trainfsm's own (which has ``ranks``) without its manifest."""
    if isinstance(training, dict) and "ranks" in training:  # trainfsm's own training state
        raise CheckpointError(
            f"{path} looks like a trainfsm checkpoint whose {MANIFEST} is missing: without it the files "
            f"cannot be verified, so it is not loaded (restore the manifest, or move the directory away)"
        )
    if not isinstance(training, dict) or not all(key in training for key in TRAINING_KEYS):
        raise CheckpointError(
            f"{path / 'training_state.pt'} does not hold trainloop's training state "
            f"(a dict with {', '.join(TRAINING_KEYS)}); it was not written by trainloop's CheckpointingHook"
        )
