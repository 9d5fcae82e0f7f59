"""CudaMaxMemoryHook: one clear warning and no work on CPU; per-step peaks in GiB on CUDA (the GPU
tier, ``make test-gpu``: the tests marked ``cuda``), read against ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer, read_events
from trainfsm import BaseHook
from trainfsm.hooks.cuda_memory import CUDAMaxMemoryHook, CudaMaxMemoryHook, CudaMemoryUnavailableWarning


class StepInfo(BaseHook):
    """Copies ``step_info`` after every step (listed after the memory hook)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_after_step(self, trainer: Any) -> None:
        self.seen.append(dict(trainer.step_info))


def test_on_cpu_it_warns_once_records_it_and_sets_nothing(tmp_path: Path) -> None:
    info = StepInfo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[CudaMaxMemoryHook(), info]).train()
    ours = [w for w in caught if issubclass(w.category, CudaMemoryUnavailableWarning)]
    assert len(ours) == 1
    assert "runs on cpu, not on CUDA" in str(ours[0].message)
    assert Path(ours[0].filename) == Path(__file__)  # points at the user's train() call, not at trainfsm
    events = [e for e in read_events(tmp_path) if e["event"] == "cuda_memory_unavailable"]
    assert [e["device"] for e in events] == ["cpu"]
    assert len(info.seen) == 4 and all("max_memory" not in seen for seen in info.seen)
    assert read_events(tmp_path)[-1]["reason"] == "completed"


def test_on_cpu_the_per_step_method_does_nothing(tmp_path: Path) -> None:
    hook = CudaMaxMemoryHook()
    with pytest.warns(CudaMemoryUnavailableWarning):
        TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[hook]).train()
    assert hook.device is None
    trainer = TinyTrainer(max_steps=1)
    hook.on_step_info(trainer, trainer.step_info)  # no CUDA call: would raise without CUDA
    assert trainer.step_info == {}


def test_the_alias_is_the_same_class() -> None:
    assert CUDAMaxMemoryHook is CudaMaxMemoryHook


class CudaTrainer(TinyTrainer):
    """TinyTrainer on CUDA: the batches move to the device, and each step allocates ``extra`` MiB."""

    def __init__(self, extra_mib: dict[int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra_mib = extra_mib

    def build_model(self) -> Any:
        return super().build_model().to(self.device)

    def forward(self, input: Any) -> Any:
        mib = self.extra_mib.get(self.step, 0)
        scratch = torch.empty(mib * 2**20, dtype=torch.uint8, device=self.device)  # freed at return
        del scratch
        moved = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input.items()}
        return super().forward(moved)


@pytest.mark.cuda
def test_on_cuda_each_step_reports_its_own_peak_in_gib(tmp_path: Path) -> None:
    info = StepInfo()
    trainer = CudaTrainer({2: 512}, max_steps=3, workspace=tmp_path, device="cuda", hooks=[CudaMaxMemoryHook(), info])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaMemoryUnavailableWarning)
        trainer.train()
    peaks = [seen["max_memory"] for seen in info.seen]
    assert len(peaks) == 3 and all(isinstance(p, float) and p > 0 for p in peaks)
    assert peaks[1] >= 0.5  # step 2 held 512 MiB at its peak
    assert peaks[2] < 0.25  # reset after step 2: step 3's peak does not include it
    assert not [e for e in read_events(tmp_path) if e["event"] == "cuda_memory_unavailable"]


class PeakProbe(BaseHook):
    """Listed before the memory hook: reads ``torch.cuda.max_memory_allocated`` in ``on_step_info``,
    just before the hook reads it and resets the peak."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_step_info(self, trainer: Any, info: Any) -> None:
        self.peaks.append(torch.cuda.max_memory_allocated(trainer.device))


@pytest.mark.cuda
def test_on_cuda_max_memory_is_torchs_max_memory_allocated_since_the_last_step_in_gib(tmp_path: Path) -> None:
    probe, info = PeakProbe(), StepInfo()
    scratch = {2: 256, 4: 768}  # MiB held at once inside steps 2 and 4
    trainer = CudaTrainer(
        scratch, max_steps=5, workspace=tmp_path, device="cuda", hooks=[probe, CudaMaxMemoryHook(), info]
    )
    trainer.train()
    reported = [seen["max_memory"] for seen in info.seen]
    assert reported == [peak / 2**30 for peak in probe.peaks]  # the same number, in GiB
    assert [seen["cuda_max_memory"] for seen in info.seen] == reported  # trainloop 0.11's key too
    # Each step's own peak: a step's scratch shows in its own value only (the peak is reset after it).
    base = max(reported[i] for i in (0, 2, 4))
    assert base < 0.1  # Linear(3, 1), its gradients and batches: far under 256 MiB
    for index, mib in ((1, 256), (3, 768)):
        assert mib / 1024 <= reported[index] <= mib / 1024 + base + 0.01
    assert reported[4] < 0.25  # step 5 after step 4's 768 MiB
