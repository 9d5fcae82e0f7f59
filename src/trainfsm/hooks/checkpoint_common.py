"""The trainer's ``state_dict_options`` swapped for a sharded save or load, in one place until
``trainer.state_dict()`` / ``load_state_dict()`` take the options as a parameter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer


@contextlib.contextmanager
def state_dict_options(trainer: BaseTrainer, options: Any) -> Iterator[None]:
    """``trainer.state_dict()`` / ``load_state_dict()`` with ``options`` (a sharded save or load uses
    each rank's shards, whatever the trainer's own options say), then the trainer's own again."""
    saved = trainer.state_dict_options
    trainer.state_dict_options = options
    try:
        yield
    finally:
        trainer.state_dict_options = saved
