"""Hooks: one module each."""

from trainfsm.hooks.base import BaseHook

__all__ = ["BaseHook"]
