"""Shared fixtures; the trainer, hook and trail readers they use live in ``tests/helpers.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import TinyTrainer, read_events


@pytest.fixture
def make_trainer(tmp_path: Path) -> Callable[..., TinyTrainer]:
    """``make_trainer(**kwargs)``: a TinyTrainer writing its audit trail under ``tmp_path``."""

    def factory(**kwargs: Any) -> TinyTrainer:
        kwargs.setdefault("workspace", tmp_path)
        kwargs.setdefault("max_steps", 3)
        return TinyTrainer(**kwargs)

    return factory


@pytest.fixture
def events(tmp_path: Path) -> Callable[[], list[dict[str, Any]]]:
    """``events()``: the events written under ``tmp_path`` so far."""
    return lambda: read_events(tmp_path)
