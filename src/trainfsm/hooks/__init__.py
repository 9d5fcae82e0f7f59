"""Hooks: one module each."""

from trainfsm.hooks.base import BaseHook
from trainfsm.hooks.checkpointing import CheckpointingHook

__all__ = ["BaseHook", "CheckpointingHook"]
