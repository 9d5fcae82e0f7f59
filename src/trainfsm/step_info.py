"""``StepInfo``: what ``trainer.step_info`` holds after a step, typed.

It stays a ``dict`` with trainloop's keys, because that is what users' code and published hooks
read (``step_info["loss"]``, ``"grad_norm" in step_info``, ``json.dumps``, ``dict(step_info)``),
and a ``dict`` is the cheapest object a step can make. The properties give the same values with
a type a reader and a type checker can see; the figures a hook adds go in its ``on_step_info``,
which runs for every hook before any hook's ``on_after_step``, so readers need not be listed
after writers.
"""

from __future__ import annotations

from typing import Any

import torch


class StepInfo(dict[str, Any]):
    """One optimizer step's figures, by trainloop's keys (the machine-and-hooks guide lists them).

    ``loss``, ``records`` and ``data_time`` are per micro-batch lists, as trainloop has them;
    ``loss`` and ``grad_norm`` are tensors on the device (reading them is a host sync). Keys a hook
    adds (``max_memory`` from ``CudaMaxMemoryHook``, or your own) are plain items.
    """

    __slots__ = ()

    @property
    def loss(self) -> list[torch.Tensor]:
        """The micro-batches' detached losses."""
        return self["loss"]  # type: ignore[no-any-return]

    @property
    def records(self) -> list[Any]:
        """The micro-batches' records, as ``forward`` returned them."""
        return self["records"]  # type: ignore[no-any-return]

    @property
    def data_time(self) -> list[float]:
        """Seconds each batch took to draw (retried and ``loss=None`` micro-batches too)."""
        return self["data_time"]  # type: ignore[no-any-return]

    @property
    def step_time(self) -> float:
        """Seconds from the step's start to its optimizer step's end."""
        return self["step_time"]  # type: ignore[no-any-return]

    @property
    def non_finite_grad_retries(self) -> int:
        """The retries this step took (also under trainloop 0.5's ``non_finite_grad_retry_count``)."""
        return self["non_finite_grad_retries"]  # type: ignore[no-any-return]

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The gradients' norm before clipping, with ``grad_clip``; None without."""
        return self.get("grad_norm")

    @property
    def max_memory(self) -> float | None:
        """The step's peak CUDA memory in GiB, with ``CudaMaxMemoryHook``; None without."""
        return self.get("max_memory")
