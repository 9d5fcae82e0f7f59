"""Asynchronous checkpoint saves (``CheckpointingHook(async_save=True)``): stage, then write in the
background while training goes on.

``stage`` makes a private CPU copy of what a save writes: what a forward pass may change in place at
once, the rest (parameters, optimizer and hook state) on the writer thread while the next step
runs, until its optimizer step, which waits for those copies (``BackgroundSaves.wait_staged``).
The CPU tensors of one save are kept for the next (``BackgroundSaves.spare``), which copies into
those of the same shape: memory touched once, not page-faulted anew at every save (one CPU copy of
the state stays allocated between saves). RESTORE makes them for the parameters and whatever
optimizer state exists then (``prestage``), so that the first save finds them too.
A CUDA tensor's copy is pinned (page-locked) host memory, written by the copy engine on a CUDA
stream of the writer's own (``_CopyStream``): the next step's kernels run beside it, and the
writer waits for the stream, not the device, before the loop may step. Pinning is paid once, as
the copies are kept; pageable memory would make each save's copy go through a staging buffer at a
fraction of the bus's speed, serialised with the step's kernels on the default stream.
The loop waits for ``stage`` and ``submit``, after a step that left the CPU's caches cold: they
touch as few objects as they can (see ``stage``).
``BackgroundSaves`` runs the writes on one thread, at most one in flight; ``settle`` reports a
finished one and raises for a failed one. A sharded save's collectives run over a gloo group of its
own (``process_group``), so that they never pair with the training's on the main thread. The
thread times each write itself (``WriteTimes``): the job's end (``trainfsm.preemption.deadline``)
plans for what a save still has to write after the loop moved on, which the CHECKPOINT state it
watches does not contain.
"""

from __future__ import annotations

import _thread
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from trainfsm import activity
from trainfsm.checkpoint.store import CheckpointError
from trainfsm.utils import local_part, map_nested_tensor

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

Result = TypeVar("Result")


class WriteTimes:
    """The writer thread's own clock, read by the watchdog's thread for the job's end: the slowest
    write of this attempt (its copies, then ``write()``, as ``EXIT`` would wait for them) and when
    the write in flight began (epoch seconds, the deadline's clock; None: none in flight). Two
    attribute writes per save, no lock: a look that reads one before the other is a quarter of a
    second from the next."""

    __slots__ = ("began", "slowest")

    def __init__(self) -> None:
        self.slowest = 0.0
        self.began: float | None = None

    def unwritten(self, now: float) -> tuple[float, float]:
        """(the write a save started now would need, at least the slowest one or what the write in
        flight has taken so far; what the write in flight still has, at that rate, to write first)."""
        began = self.began
        if began is None:
            return self.slowest, 0.0
        elapsed = max(now - began, 0.0)
        write = max(self.slowest, elapsed)
        return write, write - elapsed


class BackgroundSaves(Generic[Result]):
    """One writer thread and the save in flight on it, from ``submit`` to ``settle``."""

    def __init__(self) -> None:
        self._writer: ThreadPoolExecutor | None = None
        self._inflight: Future[Result] | None = None
        self._inflight_sharded = False
        self._failure_reported = False
        # Held until the copies of the save in flight are made: a bare lock, made at each save
        # (a threading.Event is a Condition of Python objects: ~60 µs more, caches cold).
        self._staging: Any = None
        self._blocked = 0.0  # how long the loop waited for the save in flight
        self._group: Any = None  # the process group of background sharded saves (made at the first)
        #: CPU tensors to stage the next save into (those of the last save, or ``prestage``'s): it
        #: starts only once the last one settled, so nothing reads them any more.
        self.spare: list[torch.Tensor] = []
        self.times = WriteTimes()
        self._stream = _CopyStream()

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def start(self, world_size: int, sharded: bool) -> None:
        """Start the writer thread now, and for sharded saves on several ranks make their process
        group (collective: every rank calls this in RESTORE), so that the first save does neither."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainfsm-async-save")
            self._writer.submit(lambda: None).result()  # a pool starts its thread at its first task
        if sharded:
            self.process_group(world_size)

    def prestage(self, trainer: BaseTrainer, sharded: bool) -> None:
        """Make and touch, in RESTORE, the CPU tensors the first save will stage its parameters and
        optimizer state into (the optimizer's as far as it exists: after a resume, all of it): on
        the rank that writes a full checkpoint, and on every rank for sharded ones. Not where
        the saved tensors are whole and the parameters shards (a full state dict of FSDP)."""
        model, optimizer = trainer.model, trainer.optimizer
        if model is None or optimizer is None or not (sharded or trainer.rank == 0):
            return
        parameters = list(model.parameters())
        if not sharded and any(hasattr(p, "placements") for p in parameters):
            return
        state = [t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        self.spare = [host_copy(local_part(t).detach(), zeros=True) for t in parameters + state]

    def submit(
        self,
        started: float,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        write: Callable[[], Result],
        *,
        sharded: bool,
    ) -> None:
        """Make ``copies`` on the writer thread, then ``write()`` there; the loop was blocked since
        ``started``, and is blocked again before the next optimizer step until the copies are made."""
        self._blocked = time.perf_counter() - started
        self._staging = staged = _thread.allocate_lock()
        staged.acquire()
        self.spare = [target for _, target in copies]
        self._inflight_sharded = sharded
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainfsm-async-save")
        stream = self._stream.ready(copies)  # on this thread: after the step whose state is saved
        self._inflight = self._writer.submit(_copy_then, copies, staged, write, self.times, stream)

    def wait_staged(self) -> None:
        """Wait until the save in flight has its copies: the first in-place update of parameters or
        optimizer state must not come before."""
        if self._staging is not None:
            started = time.perf_counter()
            self._staging.acquire()  # released by the writer once its copies are made
            self._blocked += time.perf_counter() - started
            self._staging = None

    def settle(self, trainer: BaseTrainer, wait: bool) -> tuple[Result, float] | None:
        """A finished save's result and the seconds the loop was blocked for it; with ``wait``, wait
        for it. A failed save raises here: a full one at the next step, a sharded one at the next
        checkpoint or at EXIT. The ranks of a sharded save learn its outcome together but each looks
        at its own pace, so each would raise at a different step and leave the others waiting in a
        collective; the checkpoint and EXIT are where every rank is at once. The
        ``checkpoint_failed`` event comes at the next step either way."""
        future = self._inflight
        if future is None or (not wait and not future.done()):
            return None
        self.wait_staged()
        error = future.exception()
        if error is None:
            self._inflight = None
            return future.result(), self._blocked
        if not self._failure_reported:
            trainer.events.error("checkpoint_failed", type=type(error).__name__, message=str(error))
            self._failure_reported = True
        if not wait and self._inflight_sharded:
            return None  # raised where every rank is at once: the next checkpoint or EXIT
        self._inflight = None
        self._failure_reported = False
        raise CheckpointError(f"asynchronous checkpoint save failed: {type(error).__name__}: {error}") from error

    def process_group(self, world_size: int) -> Any:
        """The gloo group of background sharded saves, made at the first (collective: every rank
        calls this at the same save); None for one rank, which has no collective to mispair."""
        if self._group is None and world_size > 1:
            self._group = _background_group()
        return self._group

    def close(self) -> None:
        """Release the writer thread and the process group (after ``settle(wait=True)``)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._group is not None:  # local for gloo; a group kept alive could abort the exit
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


def _background_group() -> Any:
    """A gloo group over every rank for the collectives of background sharded saves (DCP's and
    ours): on the default group they could pair with the training's, which run at the same time on
    the main thread. Collective: every rank calls it at the same point."""
    import torch.distributed as dist

    from trainfsm.collectives import group_timeout

    return dist.new_group(backend="gloo", timeout=group_timeout())


class _CopyStream:
    """The CUDA stream the writer copies a save's CUDA tensors on, made at the first such save.

    ``ready`` runs on the loop's thread as a save is submitted: it records an event on the loop's
    current stream, after the work that made the state being saved, for the copies to wait for.
    Copies on the loop's own (default) stream would queue behind the next step's kernels, or they
    behind the copies; on this stream the copy engine moves the bytes while the kernels run."""

    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream: Any = None

    def ready(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, Any] | None:
        """(stream, event) for copies from one CUDA device into pinned memory; None otherwise (CPU
        tensors, or several devices: plain blocking copies, as before)."""
        if not copies or not copies[0][0].is_cuda:  # one look on CPU: a save's loop time counts
            return None
        devices = {source.device for source, _ in copies if source.is_cuda}
        if len(devices) != 1 or not all(target.is_pinned() for source, target in copies if source.is_cuda):
            return None
        (device,) = devices
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return self.stream, event


def host_copy(tensor: torch.Tensor, zeros: bool = False) -> torch.Tensor:
    """A CPU tensor of ``tensor``'s layout to copy it into: pinned when ``tensor`` is on CUDA (see
    the module's docstring), touched at once with ``zeros`` (``prestage``)."""
    make = torch.zeros_like if zeros else torch.empty_like
    return make(tensor, device="cpu", pin_memory=tensor.is_cuda)


def _copy_then(
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    staged: Any,
    write: Callable[[], Any],
    times: WriteTimes,
    stream: tuple[Any, Any] | None = None,
) -> Any:
    """On the writer thread: the copies the loop waits for before its next optimizer step, then
    ``write()``; ``times`` measures both (a failed write's time counts too: the next may take it).
    With ``stream`` (``_CopyStream.ready``) CUDA tensors are copied on that stream once its event
    passed, without blocking, and the thread waits for the stream before the loop may step."""
    times.began = began = time.time()
    try:
        try:
            with torch.no_grad():  # the sources are not detached (``stage``): record no graph
                if stream is None:
                    for source, target in copies:
                        target.copy_(source)  # releases the GIL: overlaps the next step's forward/backward
                else:
                    side, event = stream
                    with torch.cuda.stream(side):
                        side.wait_event(event)  # the state as the saved step left it
                        for source, target in copies:
                            target.copy_(source, non_blocking=source.is_cuda)  # pinned: the copy engine
                    side.synchronize()  # releases the GIL; the copies are in host memory after it
        finally:
            staged.release()
        return write()
    finally:
        times.slowest = max(times.slowest, time.time() - began)
        times.began = None


def stage(
    parts: dict[str, Any], trainer: BaseTrainer, spare: list[torch.Tensor] | None = None
) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A private CPU copy of ``parts`` for the background writer, and the copies still to make.

    What a forward pass may change in place (buffers such as BatchNorm's running statistics, and
    anything else that is not a parameter) is copied now. Parameters, optimizer state and hook
    state change only from the next ``optimizer.step()`` on, so they are copied on the writer
    thread while the next step's data loading, forward and backward run; ``on_before_optimizer_step``
    waits for those copies. Those go into ``spare`` tensors of the same shape, dtype and strides
    where there are any, so that a save of the same state allocates nothing.

    The loop waits for all of this, after a step that left the CPU's caches cold: every object
    touched costs. So a save of the same structure as the last takes the last one's targets in
    their order, checking only each one's layout, and plain tensors skip the DTensor checks.
    """
    parameters = _parameter_pointers(trainer.model)
    staging = _Staging(spare or [])
    later, now = staging.later, staging.now

    def in_model(tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is torch.Tensor:
            return later(tensor) if tensor.data_ptr() in parameters else now(tensor)
        return later(tensor) if local_part(tensor).data_ptr() in parameters else now(tensor)

    staged = {part: map_nested_tensor(in_model if part == "model" else later, value) for part, value in parts.items()}
    return staged, staging.copies


class _Staging:
    """The copies one ``stage`` makes, and the targets it takes: ``spare``'s in order while each
    has the layout wanted, then from a pool of the rest by layout, then new ones."""

    def __init__(self, spare: list[torch.Tensor]) -> None:
        self.spare = spare
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pool: dict[tuple[Any, ...], list[torch.Tensor]] | None = None  # once the order differs

    def later(self, tensor: torch.Tensor) -> torch.Tensor:
        plain = type(tensor) is torch.Tensor
        local = tensor if plain else local_part(tensor).detach()  # copied under no_grad: no detach
        copies, spare = self.copies, self.spare
        index = len(copies)
        target: torch.Tensor | None = None
        if self.pool is None and index < len(spare):
            candidate = spare[index]
            if (
                candidate.shape == local.shape
                and candidate.dtype == local.dtype
                and candidate.stride() == local.stride()
            ):
                target = candidate
            else:  # popped in their order
                self.pool = {}
                for unused in reversed(spare[index:]):
                    self.pool.setdefault(_layout(unused), []).append(unused)
        if target is None:
            same = self.pool.get(_layout(local)) if self.pool is not None else None
            target = same.pop() if same else host_copy(local)
        copies.append((local, target))
        return target if plain else _shaped_like(tensor, target)

    def now(self, tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is torch.Tensor:
            return tensor.detach().to("cpu", copy=True)
        return _shaped_like(tensor, local_part(tensor).detach().to("cpu", copy=True))


#: model -> its parameters, where each is a plain ``nn.Parameter``: walking the modules for them
#: again at every save costs, in a loop whose caches the step before left cold.
_parameters: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def _parameter_pointers(model: Any) -> set[int]:
    """Where ``model``'s parameters' data is now: a model state tensor there is a parameter.

    The parameters of a model whose parameters are all plain are kept from the first save (held,
    so that their memory stays theirs), and their pointers taken anew at each save: a parameter's
    storage swapped (``p.data = ...``) is seen. One added to the model later (it is not in this
    list) is copied before the loop goes on, as a buffer is: a slower save, never a wrong one.
    Other models (DTensor parameters, whose local storage FSDP swaps) are walked at every save."""
    if model is None:
        return set()
    kept = _parameters.get(model)
    if kept is None:
        found = list(model.parameters())
        if not all(type(p) is nn.Parameter for p in found):
            return {local_part(p).data_ptr() for p in found}
        kept = _parameters[model] = found
    return {p.data_ptr() for p in kept}


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tensor.shape, tensor.dtype, tensor.stride()


def _shaped_like(original: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a CPU copy of ``original``'s part) as what DCP must see: a DTensor with the same
    mesh, placements and global shape when ``original`` is one, so that it is written as the same
    shard of the same global tensor.

    Made with DTensor's own constructor from ``original``'s spec, not ``DTensor.from_local``: that
    moves the local tensor to the mesh's device (a CUDA mesh: a new GPU tensor), and the writer
    thread's later copy into ``local`` would then never reach what DCP writes. torch's own stager
    (``_create_cpu_state_dict``) keeps the CPU tensor the same way, by setting ``_local_tensor``."""
    if not hasattr(original, "placements"):
        return local
    dtensor: Any = original
    staged: torch.Tensor = type(dtensor)(local, dtensor._spec, requires_grad=False)
    return staged


activity.name(BackgroundSaves.settle, "waiting for the asynchronous save in flight")
activity.name(BackgroundSaves.wait_staged, "waiting for the asynchronous save's copies")
