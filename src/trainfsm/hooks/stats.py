"""``StatsHook`` and ``TrainingStats``: the one way the step stats are averaged over an interval.

``LoggingHook`` and ``ProgressHook`` are ``StatsHook`` subclasses; a user's own consumer is one too
(``StatsHook(callback)`` or a subclass overriding ``on_stats``), as in ``trainloop`` 0.11.

Per step it only keeps references and adds host numbers: the step's micro-batch losses (detached
tensors on their device) are averaged with one kernel and kept, no sync; the records are averaged
over the step's micro-batches with ``key_average`` (tensors stay tensors); data and step times and
the retry count are host numbers already. At the interval's last step ``summarize()`` turns it all
into floats with one device-to-host copy, and with ``sync=True`` on more than one rank, one
``all_reduce`` of one packed tensor before it.

``TrainingStats``, each over the interval's steps (a key only some steps have: over those):

- ``loss``: the mean of each step's mean micro-batch loss;
- ``grad_norm``: the mean total norm before clipping (None without ``grad_clip``);
- ``step_time``: mean seconds per step; ``data_time``: the mean per step of the time spent
  drawing its micro-batches (their sum);
- ``non_finite_grad_retries``: retries per step;
- ``cuda_max_memory``: the interval's peak GiB (the largest step value), when a hook such as
  ``CudaMaxMemoryHook`` put ``step_info["max_memory"]`` there (in ``on_step_info``, before any
  hook's ``on_after_step``);
- ``records``: the user's records, nested as returned, ``key_average`` over steps of each step's
  ``key_average`` over micro-batches;
- ``param_groups``: one dict per optimizer param group with the ``param_group_keys`` it has
  (default ``name`` and ``lr``), as used by the interval's last step (read before the optimizer
  step, so before the scheduler moves the rate on).

Across ranks (``sync=True``) every number is the mean over ranks of the per-rank values (for
``cuda_max_memory``: the mean of the ranks' peaks); ``param_groups`` are this rank's. All ranks
must produce the same keys (same records keys, all clipping or none): the packed tensor carries a
checksum of the key names, and when it differs between ranks every rank raises the same
``ValueError``. When even the number of values differs the collective itself fails (gloo aborts
one process and the other raises; NCCL may hang until its timeout), so give every rank the same
records keys.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainfsm import collectives
from trainfsm import options as check
from trainfsm.hooks.base import BaseHook
from trainfsm.utils import key_average

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

#: Key-name checksums are 16-bit, so sums of squares stay exact in float64 for up to 2**21 ranks.
_SIGNATURE_BITS = 16


@dataclass(frozen=True, slots=True)
class TrainingStats:
    """One interval's averages, as host floats (see the module doc for each field)."""

    loss: float
    grad_norm: float | None
    step_time: float
    data_time: float
    non_finite_grad_retries: float
    cuda_max_memory: float | None
    records: dict[str, Any] = field(default_factory=dict)  #: nested as the user returned them
    param_groups: list[dict[str, Any]] = field(default_factory=list)


def flat(records: Mapping[str, Any], separator: str = "/") -> dict[str, Any]:
    """Nested keys joined: ``{"m": {"acc": 1.0}}`` -> ``{"m/acc": 1.0}``."""
    return {separator.join(path): value for path, value in _flatten(records, ())}


class IntervalStats:
    """The engine of ``StatsHook``: ``add(trainer.step_info)`` per step, ``summarize()`` per interval.

    ``owner`` names the hook in error messages. ``records=False`` skips the user's records (a
    progress line without them need not average them). Call ``start(trainer)`` once before the
    first step (``on_before_train``), ``add_param_groups()`` from ``on_before_optimizer_step`` and
    ``add(trainer.step_info)`` from ``on_after_step``.
    """

    __slots__ = (
        "_data_time",
        "_distributed",
        "_grad_norms",
        "_groups",
        "_keys",
        "_losses",
        "_memory",
        "_names",
        "_param_groups",
        "_records",
        "_retries",
        "_signature",
        "_step_time",
        "_steps",
        "_world_size",
        "owner",
        "records",
        "sync",
    )

    def __init__(
        self, owner: str, *, sync: bool, records: bool = True, param_group_keys: tuple[str, ...] = ("name", "lr")
    ) -> None:
        self.owner = owner
        self.sync = sync
        self.records = records
        self._keys = param_group_keys
        self._groups: list[dict[str, Any]] = []
        self._param_groups: list[dict[str, Any]] = []
        self._distributed = False
        self._world_size = 1
        self._names: tuple[str, ...] = ()
        self._signature = 0
        self._reset()

    def start(self, trainer: BaseTrainer) -> None:
        """Bind the optimizer's param groups and the world size (the trainer is built)."""
        optimizer = trainer.optimizer
        self._groups = optimizer.param_groups if optimizer is not None else []
        self._world_size = trainer.world_size
        self._distributed = self.sync and trainer.world_size > 1
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._losses: list[torch.Tensor] = []
        self._grad_norms: list[torch.Tensor] = []
        self._records: list[Mapping[str, Any]] = []
        self._data_time = 0.0
        self._step_time = 0.0
        self._retries = 0
        self._memory: list[Any] = []

    # ------------------------------------------------------------------ per step: no sync, no strings
    def add_param_groups(self) -> None:
        """The param groups' ``param_group_keys`` this step's ``optimizer.step()`` is about to use.

        Read here, not after the step: the scheduler then moves the rate on to the next step's.
        A tensor value (capturable optimizers update ``lr`` in place) is copied: a kernel, no sync.
        """
        keys = self._keys
        groups = []
        for group in self._groups:
            snapshot = {}
            for key in keys:
                if key in group:
                    value = group[key]
                    snapshot[key] = value.clone() if isinstance(value, torch.Tensor) else value
            groups.append(snapshot)
        self._param_groups = groups

    def add(self, info: Mapping[str, Any]) -> None:
        """One step's ``trainer.step_info`` (trainloop's layout: per micro-batch lists)."""
        self._steps += 1
        losses = info["loss"]
        self._losses.append(losses[0] if len(losses) == 1 else torch.stack(losses).mean())
        grad_norm = info.get("grad_norm")
        if grad_norm is not None:
            self._grad_norms.append(grad_norm)
        if self.records:
            records = info["records"]
            step_records = records[0] if len(records) == 1 else key_average(records)
            if step_records:
                self._records.append(step_records)
        self._data_time += sum(info["data_time"])
        self._step_time += info["step_time"]
        self._retries += info["non_finite_grad_retry_count"]
        memory = info.get("max_memory")
        if memory is not None:
            self._memory.append(memory)

    # ------------------------------------------------------------------ per interval
    def summarize(self, step: int) -> TrainingStats:
        """Average what was collected, across ranks too when syncing, and start a new interval.

        The interval's one host sync (and, with ``sync``, its one collective) happens here.
        """
        n = self._steps
        if n == 0:
            raise RuntimeError(f"{self.owner}: summarize() called with no step collected since the last summary.")
        names: list[str] = ["loss", "data_time", "step_time", "non_finite_grad_retries"]
        values: list[Any] = [
            _mean(self._losses),
            self._data_time / n,
            self._step_time / n,
            self._retries / n,
        ]
        if self._grad_norms:
            names.append("grad_norm")
            values.append(_mean(self._grad_norms))
        if self._memory:
            names.append("cuda_max_memory")
            values.append(_peak(self._memory))
        paths: list[tuple[str, ...]] = []
        if self._records:
            for path, value in _flatten(key_average(self._records), ()):
                paths.append(path)
                names.append("records/" + "/".join(path))
                values.append(value)
        device = self._losses[0].device
        self._reset()
        floats = self._to_floats(names, values, device, step)

        by_name = dict(zip(names, floats, strict=True))
        records: dict[str, Any] = {}
        for path, value in zip(paths, floats[len(floats) - len(paths) :], strict=True):
            _insert(records, path, value)
        groups = [
            # A tensor rate (capturable optimizers) is rare: read here, once per interval and group.
            {key: (value.item() if isinstance(value, torch.Tensor) else value) for key, value in group.items()}
            for group in self._param_groups
        ]
        return TrainingStats(
            loss=by_name["loss"],
            grad_norm=by_name.get("grad_norm"),
            step_time=by_name["step_time"],
            data_time=by_name["data_time"],
            non_finite_grad_retries=by_name["non_finite_grad_retries"],
            cuda_max_memory=by_name.get("cuda_max_memory"),
            records=records,
            param_groups=groups,
        )

    def _to_floats(self, names: list[str], values: list[Any], device: torch.device, step: int) -> list[float]:
        """Host floats for ``values``: tensors are stacked and copied once; with ``sync`` everything
        goes into one tensor, all-reduced once, and divided by the world size on the host."""
        tensor_at: list[int] = []
        tensors: list[torch.Tensor] = []
        host_at: list[int] = []
        host: list[float] = []
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:  # metadata only, no sync
                    raise ValueError(
                        f"{self.owner}: {names[i]!r} is a tensor of shape {tuple(value.shape)}; records and "
                        f"stats must be numbers or one-element tensors."
                    )
                tensor_at.append(i)
                tensors.append(value.detach().reshape(()).to(device=device, dtype=_wide(device)))
            else:
                host_at.append(i)
                host.append(float(value))
        if self._distributed:
            sums = self._all_reduce(names, tensors, host, device, step)
            world = self._world_size
            converted = [s / world for s in sums]
            tensor_values, host_values = converted[: len(tensors)], converted[len(tensors) :]
        else:
            # Host sync: the interval's one device-to-host copy.
            tensor_values = torch.stack(tensors).tolist() if tensors else []
            host_values = host
        out: list[float] = [0.0] * len(values)
        for i, v in zip(tensor_at, tensor_values, strict=True):
            out[i] = v
        for i, v in zip(host_at, host_values, strict=True):
            out[i] = v
        return out

    def _all_reduce(
        self, names: list[str], tensors: list[torch.Tensor], host: list[float], device: torch.device, step: int
    ) -> list[float]:
        key = tuple(names)
        if key != self._names:
            self._names = key
            self._signature = zlib.crc32("\0".join(key).encode()) & ((1 << _SIGNATURE_BITS) - 1)
        signature = float(self._signature)
        # Host numbers travel with the tensors: one small host-to-device copy, then the one
        # collective. The checksum and its square come last, to check the keys below.
        tail = torch.tensor([*host, signature, signature * signature], dtype=torch.float64).to(device, _wide(device))
        packed = torch.cat([torch.stack(tensors), tail]) if tensors else tail
        collectives.sum_over_ranks(packed)  # the interval's one collective
        sums: list[float] = packed.tolist()  # host sync: once per interval
        total, squares = sums[-2], sums[-1]
        # Exact integers in float64: total**2 == world * squares holds only when every rank's
        # checksum is the same (Cauchy-Schwarz), and every rank sees the same sums, so all raise.
        if int(total) ** 2 != self._world_size * int(squares):
            raise ValueError(
                f"{self.owner}(sync=True) at step {step}: ranks averaged different keys, so their values "
                f"cannot be paired. This rank's keys: {', '.join(names)}. Every rank must return the same "
                f"records keys from forward() and have the same param groups and grad_clip; otherwise "
                f"use sync=False."
            )
        return sums[:-2]


class StatsHook(BaseHook):
    """Every ``interval`` steps (and at the run's last step: completed, stopped or preempted), call
    ``callback(trainer, stats)`` with the interval's ``TrainingStats``. Every rank calls back;
    decide in the callback which rank writes (``trainer.rank == 0``). State: none worth saving; the
    first interval after a resume averages the steps this attempt ran.

    Arguments:

    - ``callback`` (default None): called with ``(trainer, stats)``; None: subclass it and override
      ``on_stats`` instead, as ``LoggingHook`` and ``ProgressHook`` do.
    - ``interval`` (default 10): steps per call.
    - ``sync`` (default True): average across ranks first (one collective per interval; none when
      not distributed).
    - ``param_group_keys`` (default ``("name", "lr")``): which keys of each optimizer param group land
      in ``stats.param_groups`` (those a group has).
    """

    #: ``records=False`` in a subclass skips averaging the user's records (ProgressHook without them).
    _with_records = True

    def __init__(
        self,
        callback: Callable[[BaseTrainer, TrainingStats], Any] | None = None,
        interval: int = 10,
        sync: bool = True,
        param_group_keys: Sequence[str] = ("name", "lr"),
    ) -> None:
        owner = type(self).__name__
        if callback is not None and not callable(callback):
            raise TypeError(f"{owner} callback must be callable(trainer, stats) or None; got {callback!r}.")
        if callback is None and type(self).on_stats is StatsHook.on_stats:
            raise TypeError(
                f"{owner} needs a callback(trainer, stats), or a subclass that overrides on_stats(trainer, stats)."
            )
        if isinstance(param_group_keys, str) or not all(isinstance(k, str) for k in param_group_keys):
            raise TypeError(
                f"{owner} param_group_keys must be a sequence of param-group key names, e.g. ('name', 'lr'); "
                f"got {param_group_keys!r}."
            )
        self.callback = callback
        self.interval: int = check.positive_int(f"{owner} interval", interval)  # type: ignore[assignment]
        self.sync = check.boolean(f"{owner} sync", sync)
        self.param_group_keys = tuple(param_group_keys)
        self._stats = IntervalStats(
            owner, sync=self.sync, records=self._with_records, param_group_keys=self.param_group_keys
        )
        self._add = self._stats.add
        self._add_param_groups = self._stats.add_param_groups
        self._active = True  # does this rank collect at all

    def collects(self, trainer: BaseTrainer) -> bool:
        """Whether this rank collects (every rank; ``ProgressHook`` without sync: rank 0 only)."""
        return True

    def on_before_train(self, trainer: BaseTrainer) -> None:
        self._active = self.collects(trainer)
        self._stats.start(trainer)

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        if self._active:
            self._add_param_groups()

    def on_after_step(self, trainer: BaseTrainer) -> None:
        if not self._active:
            return
        self._add(trainer.step_info)
        step = trainer.step
        if step % self.interval == 0 or trainer.exit_reason is not None:
            stats = self._stats.summarize(step)  # the interval's host sync (and collective)
            self.on_stats(trainer, stats)

    def on_stats(self, trainer: BaseTrainer, stats: TrainingStats) -> None:
        """One interval's stats: calls ``callback(trainer, stats)``; subclasses override it."""
        if self.callback is not None:
            self.callback(trainer, stats)


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The mean of same-device scalar tensors, on their device (kernels, no sync)."""
    if len(tensors) == 1:
        return tensors[0]
    return torch.stack(tensors).to(_wide(tensors[0].device)).mean()  # a 0-d mean of every element


def _wide(device: torch.device) -> torch.dtype:
    """float64 for sums of many steps, where the device has it (MPS has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _peak(values: list[Any]) -> Any:
    """The largest value: host numbers (CudaMaxMemoryHook's) on the host, tensors on their device."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    if device is None:
        return max(values)
    return torch.stack([torch.as_tensor(v, dtype=_wide(device), device=device).reshape(()) for v in values]).max()


def _flatten(records: Mapping[str, Any], prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    out: list[tuple[tuple[str, ...], Any]] = []
    for key, value in records.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            out.extend(_flatten(value, path))
        else:
            out.append((path, value))
    return out


def _insert(records: dict[str, Any], path: tuple[str, ...], value: float) -> None:
    node = records
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
