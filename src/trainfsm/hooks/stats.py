"""``IntervalStats``: what ``ProgressHook`` and ``LoggingHook`` average over their interval.

Per step it only keeps references and adds host numbers: the loss and grad norm stay tensors on
their device (appended to a list, no kernel, no sync), the records dict is kept as the trainer
made it (so a ``forward`` must return a new dict each step, not one it mutates in place), times
and retries are host floats already. At the interval's last step ``summarize()``
turns it all into floats with one device-to-host copy, and with ``sync=True`` on more than one
rank, one ``all_reduce`` of one packed tensor before it.

What a summary holds, each averaged over the interval's steps (a key that only some steps have:
over the steps that have it):

- ``loss``, ``grad_norm`` (when the trainer clips and so computes it), ``data_time``,
  ``step_time``, ``non_finite_grad_retries`` (retries per step);
- ``lrs``: the learning rate of every optimizer param group, as used by each step's
  ``optimizer.step()`` (read in ``on_before_optimizer_step``; read after the step, it would be the
  scheduler's rate for the *next* step);
- ``records``: the user's records, nested as returned, averaged with ``key_average``;
- ``max_memory``: the interval's peak (the largest step value, not the mean), when a hook put
  ``step_info["max_memory"]`` there before this hook's ``on_after_step`` ran.

Across ranks (``sync=True``) every number is the mean over ranks of the per-rank values (for
``max_memory``: the mean of the ranks' peaks). All ranks must produce the same keys (same records
keys, same number of param groups, all clipping or none): the packed tensor carries a checksum of
the key names, and when it differs between ranks every rank raises the same ``ValueError``. When
even the number of values differs the collective itself fails (gloo aborts one process and the
other raises; NCCL may hang until its timeout), so give every rank the same records keys.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainfsm.utils import key_average

if TYPE_CHECKING:
    from trainfsm.trainer import BaseTrainer

#: Key-name checksums are 16-bit, so sums of squares stay exact in float64 for up to 2**21 ranks.
_SIGNATURE_BITS = 16


@dataclass(slots=True)
class IntervalSummary:
    """One interval's averages, as host floats."""

    step: int  #: the trainer step the interval ended at
    steps: int  #: how many steps it averaged (fewer for a tail or the first interval after resume)
    loss: float
    grad_norm: float | None
    data_time: float
    step_time: float
    non_finite_grad_retries: float
    max_memory: float | None
    lrs: tuple[float, ...]
    records: dict[str, Any] = field(default_factory=dict)  #: nested as the user returned them

    def scalars(self) -> dict[str, float]:
        """The trainer's stats under their published names (``lr_0``, ``lr_1``, ...)."""
        out: dict[str, float] = {"loss": self.loss}
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        out["data_time"] = self.data_time
        out["step_time"] = self.step_time
        out["non_finite_grad_retries"] = self.non_finite_grad_retries
        if self.max_memory is not None:
            out["max_memory"] = self.max_memory
        for i, lr in enumerate(self.lrs):
            out[f"lr_{i}"] = lr
        return out

    def flat_records(self) -> dict[str, float]:
        """The records with nested keys joined by ``/``: ``{"m": {"acc": 1.0}}`` -> ``{"m/acc": 1.0}``."""
        return {"/".join(path): value for path, value in _flatten(self.records, ())}


class IntervalStats:
    """Collects ``trainer.step_info`` per step; ``summarize()`` averages and starts over.

    ``owner`` names the hook in error messages. ``records=False`` skips the user's records (a
    progress line without them need not average them). Call ``start(trainer)`` once before the
    first step (``on_before_train``), ``add_lrs()`` from ``on_before_optimizer_step`` and
    ``add(trainer.step_info)`` from ``on_after_step``.
    """

    __slots__ = (
        "_data_time",
        "_distributed",
        "_grad_norms",
        "_groups",
        "_losses",
        "_lr_counts",
        "_lr_firsts",
        "_lr_sums",
        "_memory",
        "_names",
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

    def __init__(self, owner: str, *, sync: bool, records: bool = True) -> None:
        self.owner = owner
        self.sync = sync
        self.records = records
        self._groups: list[dict[str, Any]] = []
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
        n = len(self._groups)
        self._lr_firsts: list[Any] = [0.0] * n
        self._lr_sums: list[Any] = [0.0] * n
        self._lr_counts = [0] * n

    # ------------------------------------------------------------------ per step: no sync, no strings
    def add_lrs(self) -> None:
        """The rates this step's ``optimizer.step()`` is about to use, per param group.

        Summed as differences from the interval's first rate, so a constant rate averages to
        exactly itself (``0.1 + 0.1 + 0.1`` over 3 is not ``0.1`` in floating point).
        """
        groups, firsts, sums, counts = self._groups, self._lr_firsts, self._lr_sums, self._lr_counts
        if len(groups) != len(counts):  # add_param_group() during training (e.g. unfreezing)
            grow = len(groups) - len(counts)
            firsts.extend([0.0] * grow)
            sums.extend([0.0] * grow)
            counts.extend([0] * grow)
        for i, group in enumerate(groups):
            lr = group["lr"]  # a float, or a tensor (capturable optimizers): used, never read
            if counts[i]:
                sums[i] += lr - firsts[i]
            else:  # a tensor rate is updated in place by schedulers: keep a copy (a kernel, no sync)
                firsts[i] = lr.clone() if isinstance(lr, torch.Tensor) else lr
            counts[i] += 1

    def add(self, info: Mapping[str, Any]) -> None:
        """One step's ``trainer.step_info``; keeps its tensors as they are."""
        self._steps += 1
        self._losses.append(info["loss"])
        grad_norm = info.get("grad_norm")
        if grad_norm is not None:
            self._grad_norms.append(grad_norm)
        records = info["records"]
        if records and self.records:
            self._records.append(records)
        self._data_time += info["data_time"]
        self._step_time += info["step_time"]
        self._retries += info["non_finite_grad_retries"]
        memory = info.get("max_memory")
        if memory is not None:
            self._memory.append(memory)

    # ------------------------------------------------------------------ per interval
    def summarize(self, step: int) -> IntervalSummary:
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
            names.append("max_memory")
            values.append(_peak(self._memory))
        for i, (first, total, count) in enumerate(zip(self._lr_firsts, self._lr_sums, self._lr_counts, strict=True)):
            if count:
                names.append(f"lr_{i}")
                values.append(first + total / count)
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
        return IntervalSummary(
            step=step,
            steps=n,
            loss=by_name["loss"],
            grad_norm=by_name.get("grad_norm"),
            data_time=by_name["data_time"],
            step_time=by_name["step_time"],
            non_finite_grad_retries=by_name["non_finite_grad_retries"],
            max_memory=by_name.get("max_memory"),
            lrs=tuple(by_name[name] for name in names if name.startswith("lr_")),  # in group order
            records=records,
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
        import torch.distributed as dist

        key = tuple(names)
        if key != self._names:
            self._names = key
            self._signature = zlib.crc32("\0".join(key).encode()) & ((1 << _SIGNATURE_BITS) - 1)
        signature = float(self._signature)
        # Host numbers travel with the tensors: one small host-to-device copy, then the one
        # collective. The checksum and its square come last, to check the keys below.
        tail = torch.tensor([*host, signature, signature * signature], dtype=torch.float64).to(device, _wide(device))
        packed = torch.cat([torch.stack(tensors), tail]) if tensors else tail
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)  # the interval's one collective
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
