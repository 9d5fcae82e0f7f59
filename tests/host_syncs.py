"""Count host reads of tensor values on CPU, naming the frame that made each one.

On a GPU every read of a tensor's value on the host (``item``, ``bool``, ``tolist``, ...) waits
for the device; ``torch.cuda.set_sync_debug_mode`` reports them there. On CPU nothing waits, so
nothing would notice a hook that reads a loss every step: ``HostReads`` patches the reading
methods of ``torch.Tensor`` while it counts and records, for each call, the method, the stack,
and where the run stood (a ``where()`` callback, e.g. step, state and micro-batch).

Counted: ``Tensor.item``, ``__bool__``, ``tolist``, ``cpu``, ``numpy`` (``np.asarray`` goes through
it), ``__float__``, ``__int__``, ``__index__``, ``__complex__`` (so ``float(t)``, ``int(t)``,
``math.isfinite(t)``, ``f"{t:.4f}"`` and ``if t:`` count), and ``Tensor.to`` with a CPU target
(``.to("cpu")``, ``.to(device=cpu)``): on CPU the tensor is already there, so the call is what is
counted, although a same-device ``.to`` costs nothing on a GPU. Not seen: reads that torch makes in
C++ (``torch.equal``, ``torch.allclose``, ``torch.is_nonzero``, a CPU tensor's ``copy_`` from the
device, printing a tensor): the ``cuda`` tier's sync debug mode sees those.

A read made inside another counted read (``__format__`` calling ``item``) counts once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

#: The methods whose call is a host read wherever the tensor lives.
READS = ("item", "__bool__", "tolist", "cpu", "numpy", "__float__", "__int__", "__index__", "__complex__")

ROOT = Path(__file__).resolve().parents[1]
_THIS = str(Path(__file__).resolve())
_OURS = (str(ROOT / "src") + "/", str(ROOT / "tests") + "/")


@dataclass(frozen=True)
class Read:
    """One host read: which method, who made it, and where the run stood."""

    method: str  #: "Tensor.item"
    blame: str  #: the innermost frame of this project (src/ or tests/): "src/trainfsm/step.py:Stepper.apply"
    frame: str  #: the innermost frame of all, the caller of the method (torch's own code, or ``blame``)
    line: int  #: ``frame``'s line
    where: Any  #: what ``HostReads(where=...)`` returned at the read
    thread: str

    @property
    def key(self) -> tuple[str, str]:
        """(blame, method): what a test compares, the same on any torch and any line number."""
        return self.blame, self.method

    def __str__(self) -> str:
        via = "" if self.frame == self.blame else f" -> {self.frame}"
        thread = "" if self.thread == "MainThread" else f" [thread {self.thread}]"
        return f"{self.blame}{via} called {self.method} (line {self.line}){thread}"


class HostReads:
    """Patches ``torch.Tensor``'s reading methods between ``start()`` and ``stop()`` and records
    each call in ``reads``. Use it as a context manager around the run, so an exception restores
    torch even when ``stop()`` was never reached."""

    def __init__(self, where: Callable[[], Any] = lambda: None) -> None:
        self.where = where
        self.reads: list[Read] = []
        self._saved: dict[str, Any] = {}
        self._inside = threading.local()  # a read inside a counted read is not counted again

    @property
    def counting(self) -> bool:
        return bool(self._saved)

    def start(self) -> None:
        if self.counting:
            return
        for name in (*READS, "to"):
            if name in vars(torch.Tensor):
                raise RuntimeError(f"torch.Tensor.{name} is already patched (another HostReads?)")
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._to(original) if name == "to" else self._read(name, original))

    def stop(self) -> None:
        for name in self._saved:
            delattr(torch.Tensor, name)  # torch's own is TensorBase's, seen again once ours is gone
        self._saved = {}

    def __enter__(self) -> HostReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the patches
    def _read(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        record = self._record

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return record(name, original, tensor, args, kwargs)

        read.__name__ = name
        return read

    def _to(self, original: Callable[..., Any]) -> Callable[..., Any]:
        record = self._record

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            target = _target_device(args, kwargs)
            # torch's own ``.to(device)`` calls (GradScaler, clip_grad_norm_) gather tensors onto
            # the device of the others: on one GPU a same-device no-op, so only ours count.
            if target is None or target.type != "cpu" or not _ours(sys._getframe(1)):
                return original(tensor, *args, **kwargs)
            return record("to", original, tensor, args, kwargs)

        return to

    def _record(self, name: str, original: Callable[..., Any], tensor: Any, args: Any, kwargs: Any) -> Any:
        inside = self._inside
        if getattr(inside, "active", False):
            return original(tensor, *args, **kwargs)
        inside.active = True
        try:
            caller = sys._getframe(2)  # above this and the patch
            blame, frame, line = _frames(caller)
            self.reads.append(Read(f"Tensor.{name}", blame, frame, line, self.where(), threading.current_thread().name))
            return original(tensor, *args, **kwargs)
        finally:
            inside.active = False


def _frames(caller: FrameType) -> tuple[str, str, int]:
    """(blame, frame, line): the innermost frame of this project, the caller itself, its line."""
    frame = _name(caller)
    node: FrameType | None = caller
    while node is not None:
        if _ours(node):
            return _name(node), frame, caller.f_lineno
        node = node.f_back
    return frame, frame, caller.f_lineno


def _ours(frame: FrameType) -> bool:
    """Whether ``frame`` runs this project's code (src/ or tests/, not this module)."""
    path = frame.f_code.co_filename
    return path != _THIS and path.startswith(_OURS)


def _name(frame: FrameType) -> str:
    """``file:qualname``: the file from the repository's root for ours, from site-packages for
    an installed package's (``torch/amp/grad_scaler.py``)."""
    path = Path(frame.f_code.co_filename)
    if _ours(frame):
        shown = str(path.relative_to(ROOT))
    elif "site-packages" in path.parts:
        shown = "/".join(path.parts[len(path.parts) - path.parts[::-1].index("site-packages") :])
    else:
        shown = path.name
    return f"{shown}:{frame.f_code.co_qualname}"


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """Where ``tensor.to(*args, **kwargs)`` puts it; None when it stays where it is."""
    device = kwargs.get("device")
    if device is None and args:
        first = args[0]
        if isinstance(first, torch.Tensor):
            return first.device
        if isinstance(first, (str, torch.device)) or (isinstance(first, int) and not isinstance(first, bool)):
            device = first
    if device is None:
        return None
    return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)


def by_key(reads: list[Read]) -> list[tuple[str, str]]:
    """The reads as (blame, method), in the order they happened."""
    return [read.key for read in reads]


def listing(reads: list[Read]) -> Iterator[str]:
    """One line per read, for an assertion message."""
    for read in reads:
        yield f"  {read}"
