"""ProgressHook and LoggingHook on a tiny real trainer: printed lines parsed, ``trainer.log`` calls
recorded, values checked against averages computed by hand from each step's ``step_info``.

Also run as a child process for the two-rank gloo tests:
``python -m tests.test_hooks_progress_logging --child RANK --port PORT --out DIR --scenario NAME``.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import socket
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.helpers import RecordingHook, TinyTrainer, make_batches
from trainfsm import BaseHook, BaseTrainer, CheckpointingHook, key_average
from trainfsm.hooks.logging_hook import LoggingHook
from trainfsm.hooks.progress import ProgressHook, clock_format

ROOT = Path(__file__).resolve().parents[1]

#: The documented line: ``Step   100/10000: step 0.2500s data 0.0100s eta 6:00:00 loss 0.5234 ...``.
LINE = re.compile(r"^Step +(?P<step>\d+)/(?P<max>\d+): (?P<main>[^|]*?)(?: \| (?P<records>.*))?$")


# ---------------------------------------------------------------- recording and parsing
class StepRecorder(BaseHook):
    """Per step, as host floats (the test may sync): what the hooks average, and every log call."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.logs: list[tuple[int, dict[str, Any]]] = []
        self._lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        assert trainer.optimizer is not None
        self._lrs = [float(group["lr"]) for group in trainer.optimizer.param_groups]

    def on_after_step(self, trainer: BaseTrainer) -> None:
        info = trainer.step_info
        grad_norm = info.get("grad_norm")
        self.steps.append(
            {
                "step": trainer.step,
                "loss": mean([float(loss) for loss in info["loss"]]),  # the step's micro-batches
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "data_time": sum(info["data_time"]),
                "step_time": info["step_time"],
                "retries": info["non_finite_grad_retry_count"],
                "lrs": self._lrs,
                "records": copy.deepcopy(key_average(info["records"])),
            }
        )

    def on_log(self, trainer: BaseTrainer, records: dict[str, Any], dry_run: bool = False) -> None:
        self.logs.append((trainer.step, copy.deepcopy(records)))


class MemoryHook(BaseHook):
    """Puts ``step_info["max_memory"]`` (GiB) there, as CudaMaxMemoryHook does; listed first."""

    def __init__(self, values: Sequence[float]) -> None:
        self.values = list(values)

    def on_after_step(self, trainer: BaseTrainer) -> None:
        trainer.step_info["max_memory"] = self.values[trainer.step - 1]


class TwoGroupTrainer(TinyTrainer):
    """Weight and bias in two param groups (lr and lr / 10)."""

    def build_optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None
        model: Any = self.model
        return torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": self.lr / 10}], lr=self.lr)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def intervals(steps: list[dict[str, Any]], ends: Sequence[int]) -> list[list[dict[str, Any]]]:
    """The recorded steps grouped by interval, each interval ending at one of ``ends``."""
    out, start = [], 0
    for end in ends:
        out.append([s for s in steps if start < s["step"] <= end])
        start = end
    return out


def parse(line: str) -> tuple[int, int, dict[str, str], dict[str, str]]:
    """(step, max_steps, main fields, record fields) of one progress line."""
    match = LINE.match(line)
    assert match, f"not a progress line: {line!r}"
    tokens = match["main"].split(" ")
    assert len(tokens) % 2 == 0, line
    main = dict(zip(tokens[::2], tokens[1::2], strict=True))
    assert len(main) == len(tokens) // 2, f"a field printed twice: {line!r}"
    records: dict[str, str] = {}
    if match["records"] is not None:
        pairs = match["records"].split(" ")
        records = dict(zip(pairs[::2], pairs[1::2], strict=True))
    return int(match["step"]), int(match["max"]), main, records


def printed(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("Step ")]


# ---------------------------------------------------------------- ProgressHook
def test_progress_line_averages_each_interval_and_prints_the_tail(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    recorder = StepRecorder()
    trainer = make_trainer(max_steps=12, hooks=[recorder, ProgressHook(interval=5, with_records=True)])
    trainer.train()
    lines = printed(capsys)

    assert [line.split(":")[0] for line in lines] == ["Step  5/12", "Step 10/12", "Step 12/12"]
    documented = re.compile(
        r"^Step +\d+/12: step \d+\.\d{4}s data \d+\.\d{4}s eta (-|\d+:\d\d:\d\d) "
        r"loss \d+\.\d{4} lr_0 \d\.\d{2}e[-+]\d{2}"
        r" \| loss -?\d+\.\d{4} m/batch \d+\.\d{4}$"
    )
    for line, group in zip(lines, intervals(recorder.steps, [5, 10, 12]), strict=True):
        assert documented.match(line), line
        step, max_steps, main, records = parse(line)
        assert (step, max_steps) == (group[-1]["step"], 12)
        assert list(main) == ["step", "data", "eta", "loss", "lr_0"]  # no grad_norm without grad_clip
        assert main["loss"] == f"{mean([s['loss'] for s in group]):.4f}"
        assert main["step"] == f"{mean([s['step_time'] for s in group]):.4f}s"
        assert main["data"] == f"{mean([s['data_time'] for s in group]):.4f}s"
        assert main["lr_0"] == "1.00e-01"
        # eta_warmup=10: the clock starts after step 10, so only the last line has an ETA.
        assert main["eta"] == ("0:00:00" if step == 12 else "-")
        assert records == {
            "loss": f"{mean([s['records']['loss'] for s in group]):.4f}",
            "m/batch": f"{mean([s['records']['m']['batch'] for s in group]):.4f}",
        }
    # 8 batches per epoch: steps 11 and 12 saw batches 2 and 3 of the second epoch.
    assert parse(lines[-1])[3]["m/batch"] == "2.5000"


def test_progress_without_records_prints_no_separator(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    make_trainer(max_steps=2, hooks=[ProgressHook()]).train()
    lines = printed(capsys)
    assert len(lines) == 2 and all(" | " not in line for line in lines)


def test_progress_grad_norm_is_the_interval_mean_of_the_clipping_norm(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    recorder = StepRecorder()
    make_trainer(max_steps=4, grad_clip=0.05, hooks=[recorder, ProgressHook(interval=2)]).train()
    lines = printed(capsys)
    for line, group in zip(lines, intervals(recorder.steps, [2, 4]), strict=True):
        main = parse(line)[2]
        assert list(main) == ["step", "data", "eta", "loss", "grad_norm", "lr_0"]
        assert main["grad_norm"] == f"{mean([s['grad_norm'] for s in group]):.4f}"
        assert float(main["grad_norm"]) > 0.05  # the norm before clipping, as clip_grad_norm_ returns it


def test_progress_lr_per_group_is_the_rate_each_step_used(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    def halving(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)

    recorder = StepRecorder()
    trainer = TwoGroupTrainer(
        workspace=None, max_steps=4, scheduler=halving, hooks=[recorder, ProgressHook(interval=1)]
    )
    trainer.train()
    lines = printed(capsys)
    # Step 1 used 0.1 (and 0.01); the scheduler's step after it set 0.05 for step 2, and so on.
    assert [parse(line)[2]["lr_0"] for line in lines] == ["1.00e-01", "5.00e-02", "2.50e-02", "1.25e-02"]
    assert [parse(line)[2]["lr_1"] for line in lines] == ["1.00e-02", "5.00e-03", "2.50e-03", "1.25e-03"]
    assert recorder.steps[0]["lrs"] == [0.1, 0.01]  # what optimizer.step() saw at step 1


def test_progress_eta_after_warmup_from_the_wall_clock(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    hook = ProgressHook(interval=1, eta_warmup=2)
    ticks = iter(range(100, 1000, 10))  # each read of the clock is 10 s after the previous one
    hook._clock = lambda: float(next(ticks))
    make_trainer(max_steps=6, hooks=[hook]).train()
    etas = [parse(line)[2]["eta"] for line in printed(capsys)]
    # The clock starts after step 2; each later line divides the time since by the steps since:
    # 10 s per step, times the steps left.
    assert etas == ["-", "-", "0:00:30", "0:00:20", "0:00:10", "0:00:00"]


def test_progress_eta_warmup_zero_starts_the_clock_before_the_first_step(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    hook = ProgressHook(interval=2, eta_warmup=0)
    ticks = iter(range(0, 1000, 60))
    hook._clock = lambda: float(next(ticks))
    make_trainer(max_steps=6, hooks=[hook]).train()
    # Started at 0; at step 2 it reads 60 s: 30 s per step, 4 steps left; at step 4, 120 s / 4 * 2.
    assert [parse(line)[2]["eta"] for line in printed(capsys)] == ["0:02:00", "0:01:00", "0:00:00"]


def test_progress_eta_counts_warmup_steps_of_this_attempt_after_resume(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    make_trainer(max_steps=4, hooks=[CheckpointingHook(interval=2), ProgressHook(eta_warmup=2)]).train()
    first = printed(capsys)
    assert [parse(line)[2]["eta"] for line in first][:2] == ["-", "-"]
    assert all(re.fullmatch(r"\d+:\d{2}:\d{2}", parse(line)[2]["eta"]) for line in first[2:])

    make_trainer(max_steps=8, hooks=[CheckpointingHook(interval=2), ProgressHook(eta_warmup=2)]).train()
    resumed = printed(capsys)
    assert [line.split(":")[0] for line in resumed] == ["Step 5/8", "Step 6/8", "Step 7/8", "Step 8/8"]
    etas = [parse(line)[2]["eta"] for line in resumed]
    assert etas[:2] == ["-", "-"]  # steps 1-4 ran in another process: not timed here
    assert re.fullmatch(r"\d+:\d{2}:\d{2}", etas[2]) and etas[3] == "0:00:00"


@pytest.mark.parametrize(("show_units", "seconds", "gib"), [(True, "s", "GiB"), (False, "", "")])
def test_progress_memory_is_the_interval_peak_and_show_units(
    make_trainer: Callable[..., TinyTrainer],
    capsys: pytest.CaptureFixture[str],
    show_units: bool,
    seconds: str,
    gib: str,
) -> None:
    hooks = [MemoryHook([1.5, 2.25, 0.5, 3.0]), ProgressHook(interval=2, show_units=show_units)]
    make_trainer(max_steps=4, hooks=hooks).train()
    lines = printed(capsys)
    fields = [parse(line)[2] for line in lines]
    assert [f["mem"] for f in fields] == [f"2.25{gib}", f"3.00{gib}"]
    for f in fields:
        assert list(f) == ["step", "data", "eta", "mem", "loss", "lr_0"]
        assert re.fullmatch(rf"\d+\.\d{{4}}{seconds}", f["step"]) and re.fullmatch(rf"\d+\.\d{{4}}{seconds}", f["data"])
        assert f["lr_0"] == "1.00e-01" and f["eta"] == "-"  # no unit on a rate or an ETA


def test_clock_format_has_unbounded_hours() -> None:
    assert clock_format(0.4) == "0:00:00"
    assert clock_format(59.6) == "0:01:00"
    assert clock_format(6 * 3600) == "6:00:00"
    assert clock_format(30 * 3600 + 61) == "30:01:01"


# ---------------------------------------------------------------- LoggingHook
def test_logging_hook_logs_interval_averages_at_exact_steps_and_the_tail(
    make_trainer: Callable[..., TinyTrainer],
) -> None:
    recorder = StepRecorder()
    make_trainer(max_steps=7, grad_clip=1.0, hooks=[recorder, LoggingHook(interval=3)]).train()

    assert [step for step, _ in recorder.logs] == [3, 6, 7]
    for (_, logged), group in zip(recorder.logs, intervals(recorder.steps, [3, 6, 7]), strict=True):
        assert list(logged) == ["train"]
        logged = logged["train"]
        assert list(logged) == [
            "loss",
            "m",
            "grad_norm",
            "data_time",
            "step_time",
            "non_finite_grad_retry_count",
            "lr",
        ]  # the user's records first, then the stats (trainloop's order): "loss" was a record too
        assert all(type(v) is float for k, v in logged.items() if k not in ("m", "lr"))
        assert logged["loss"] == pytest.approx(mean([s["loss"] for s in group]), rel=1e-12)
        assert logged["grad_norm"] == pytest.approx(mean([s["grad_norm"] for s in group]), rel=1e-12)
        assert logged["data_time"] == pytest.approx(mean([s["data_time"] for s in group]), rel=1e-12)
        assert logged["step_time"] == pytest.approx(mean([s["step_time"] for s in group]), rel=1e-12)
        assert logged["non_finite_grad_retry_count"] == 0.0
        assert logged["lr"] == {"group_0": 0.1}  # the rate the interval's last step used
        assert logged["m"] == {"batch": pytest.approx(mean([s["records"]["m"]["batch"] for s in group]))}


def test_logging_hook_user_records_stay_nested_and_win_a_name_clash(
    make_trainer: Callable[..., TinyTrainer],
) -> None:
    class Trainer(TinyTrainer):
        def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
            loss, _ = super().forward(input)
            return loss, {"loss": 42.0, "metrics": {"acc": torch.tensor(float(input["i"] % 2)), "deep": {"x": 1}}}

    recorder = StepRecorder()
    Trainer(workspace=None, max_steps=2, hooks=[recorder, LoggingHook(interval=2)]).train()
    ((step, logged),) = recorder.logs
    assert step == 2
    logged = logged["train"]
    assert logged["loss"] == pytest.approx(mean([s["loss"] for s in recorder.steps]), rel=1e-12)  # the stat wins
    assert logged["metrics"] == {"acc": 0.5, "deep": {"x": 1.0}}  # tensors averaged, then one host copy


def test_logging_hook_counts_retries_per_step(make_trainer: Callable[..., TinyTrainer]) -> None:
    recorder = StepRecorder()
    trainer = make_trainer(
        max_steps=4,
        max_non_finite_grad_retries=2,
        script={2: "nan", 3: "nan"},  # step 2 needs two retries (forward calls 2 and 3 are NaN)
        hooks=[recorder, LoggingHook(interval=2)],
    )
    trainer.train()
    assert [s["retries"] for s in recorder.steps] == [0, 2, 0, 0]
    assert [(step, logged["train"]["non_finite_grad_retry_count"]) for step, logged in recorder.logs] == [
        (2, 1.0),
        (4, 0.0),
    ]
    # Step 2's loss is the loss of the attempt that stepped (forward call 4), not a NaN one.
    first = recorder.logs[0][1]["train"]["loss"]
    assert first == pytest.approx((trainer.losses[0] + trainer.losses[3]) / 2, rel=1e-12)


def test_logging_hook_logs_the_partial_interval_when_a_hook_stops_training(
    make_trainer: Callable[..., TinyTrainer],
) -> None:
    recorder = StepRecorder()
    stopper = RecordingHook([], stop_at=[5])
    make_trainer(max_steps=100, hooks=[recorder, LoggingHook(interval=3), stopper]).train()
    assert [step for step, _ in recorder.logs] == [3, 5]
    tail = recorder.steps[3:5]
    assert recorder.logs[1][1]["train"]["loss"] == pytest.approx(mean([s["loss"] for s in tail]), rel=1e-12)


def test_logging_hook_with_gradient_accumulation_averages_micro_batch_records(
    make_trainer: Callable[..., TinyTrainer],
) -> None:
    recorder = StepRecorder()
    make_trainer(max_steps=2, gradient_accumulation_steps=2, hooks=[recorder, LoggingHook(interval=2)]).train()
    ((_, logged),) = recorder.logs
    logged = logged["train"]
    assert logged["m"] == {"batch": 1.5}  # batches 0, 1, 2, 3
    # TinyTrainer's records carry loss.item() per micro-batch; that record is the logged "loss".
    micro = [s["records"]["loss"] for s in recorder.steps]
    assert logged["loss"] == pytest.approx(mean(micro), rel=1e-6)  # float32 tensors vs their .item()
    assert mean(micro) == pytest.approx(mean([s["loss"] for s in recorder.steps]), rel=1e-6)


# ---------------------------------------------------------------- the hot path
class HostReads(TorchFunctionMode):
    """Counts tensor reads on the host (``item``, ``tolist``, ``float()``...) made by these hooks."""

    READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"})
    MODULES = ("trainfsm/hooks/stats.py", "trainfsm/hooks/progress.py", "trainfsm/hooks/logging_hook.py")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.READS:
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.replace("\\", "/").endswith(self.MODULES):
                    self.count += 1
                    break
                frame = frame.f_back  # type: ignore[assignment]
        return func(*args, **(kwargs or {}))


def test_hooks_read_tensors_on_the_host_once_per_interval_and_never_between(
    make_trainer: Callable[..., TinyTrainer], capsys: pytest.CaptureFixture[str]
) -> None:
    reads = HostReads()
    per_step: list[int] = []

    class Snapshot(BaseHook):
        def on_after_step(self, trainer: BaseTrainer) -> None:
            per_step.append(reads.count)

    hooks = [ProgressHook(interval=3, with_records=True), LoggingHook(interval=2), Snapshot()]
    trainer = make_trainer(max_steps=7, grad_clip=1.0, hooks=hooks)
    with reads:
        trainer.train()
    new = [b - a for a, b in zip([0, *per_step], per_step, strict=False)]
    # Progress at 3, 6, 7; logging at 2, 4, 6, 7: one copy each, nothing at other steps.
    assert new == [0, 1, 1, 1, 0, 2, 2]
    assert len(printed(capsys)) == 3


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("factory", "error", "name"),
    [
        (lambda: ProgressHook(interval=0), ValueError, "ProgressHook interval"),
        (lambda: ProgressHook(interval=-5), ValueError, "ProgressHook interval"),
        (lambda: ProgressHook(eta_warmup=-1), ValueError, "ProgressHook eta_warmup"),
        (lambda: ProgressHook(interval=2.5), TypeError, "ProgressHook interval"),
        (lambda: ProgressHook(interval=True), TypeError, "ProgressHook interval"),
        (lambda: ProgressHook(with_records="yes"), TypeError, "ProgressHook with_records"),
        (lambda: ProgressHook(sync=1), TypeError, "ProgressHook sync"),
        (lambda: ProgressHook(show_units=None), TypeError, "ProgressHook show_units"),
        (lambda: LoggingHook(interval=0), ValueError, "LoggingHook interval"),
        (lambda: LoggingHook(interval="10"), TypeError, "LoggingHook interval"),
        (lambda: LoggingHook(sync="no"), TypeError, "LoggingHook sync"),
    ],
)
def test_bad_arguments_name_the_argument(factory: Callable[[], Any], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=f"^{name} must be"):
        factory()


# ---------------------------------------------------------------- two gloo ranks
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
)


def _child(rank: int, port: int, out: Path, scenario: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=60)
    )
    calls: Counter[str] = Counter()
    for name in COLLECTIVES:  # count every collective anyone makes; the real one still runs
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)

    recorder = StepRecorder()
    result: dict[str, Any] = {}
    try:
        if scenario == "sync":
            hooks = [
                recorder,
                LoggingHook(interval=3, sync=True),
                LoggingHook(interval=3, sync=False),
                ProgressHook(interval=3, sync=True, with_records=True),
                ProgressHook(interval=2, sync=False),
            ]
            trainer = TinyTrainer(batches=make_batches(seed=10 + rank), max_steps=7, hooks=hooks)
        else:  # "keys": the ranks return different records keys of the same count

            class Trainer(TinyTrainer):
                def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
                    loss, _ = super().forward(input)
                    return loss, {f"rank{rank}_only": 1.0}

            trainer = Trainer(max_steps=4, hooks=[recorder, LoggingHook(interval=2, sync=True)])
        trainer.train()
    except ValueError as exc:
        result["error"] = str(exc)
    except Exception:
        result["crash"] = traceback.format_exc()
    finally:
        result.update(steps=recorder.steps, logs=recorder.logs, calls=dict(calls))
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two_ranks(out: Path, scenario: str, timeout: float = 120.0) -> tuple[list[dict[str, Any]], list[str]]:
    """Both ranks' results and stdout; fails (after killing both) if either runs past ``timeout``."""
    port = _free_port()
    command = [sys.executable, "-m", "tests.test_hooks_progress_logging", "--port", str(port), "--out", str(out)]
    procs = [
        subprocess.Popen(
            [*command, "--child", str(rank), "--scenario", scenario],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs: list[str] = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr
            outputs.append(stdout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert "crash" not in result, result["crash"]
    return results, outputs


@pytest.mark.distributed
def test_two_gloo_ranks_sync_averages_across_ranks_with_one_collective_per_interval(tmp_path: Path) -> None:
    results, stdout = run_two_ranks(tmp_path, "sync")
    ends = [3, 6, 7]
    local = [[mean([s["loss"] for s in group]) for group in intervals(r["steps"], ends)] for r in results]
    assert local[0] != local[1]  # different data per rank: averaging across them means something
    across = [(a + b) / 2 for a, b in zip(local[0], local[1], strict=True)]
    batches = [
        [mean([s["records"]["m"]["batch"] for s in group]) for group in intervals(r["steps"], ends)] for r in results
    ]

    for rank, result in enumerate(results):
        # Two syncing hooks, three intervals each (3, 6 and the tail at 7): six all-reduces; besides
        # them only the trainer's one broadcast of the run id at start.
        assert result["calls"] == {"broadcast": 1, "all_reduce": 6}
        synced, unsynced = result["logs"][0::2], result["logs"][1::2]
        assert [step for step, _ in synced] == [step for step, _ in unsynced] == ends
        for (_, logged), expected in zip(synced, across, strict=True):
            assert logged["train"]["loss"] == pytest.approx(expected, rel=1e-12)
        for (_, logged), expected in zip(unsynced, local[rank], strict=True):
            assert logged["train"]["loss"] == pytest.approx(expected, rel=1e-12)
        assert [logged["train"]["m"]["batch"] for _, logged in synced] == pytest.approx(
            [(a + b) / 2 for a, b in zip(batches[0], batches[1], strict=True)]
        )
        assert all(logged["train"]["lr"] == {"group_0": 0.1} for _, logged in synced)
    assert results[0]["logs"][0::2] == results[1]["logs"][0::2]  # the same numbers on both ranks

    assert stdout[1] == ""  # only rank 0 prints
    lines = [line for line in stdout[0].splitlines() if line.startswith("Step ")]
    synced_lines = [line for line in lines if parse(line)[3]]  # the with_records hook's lines
    assert [parse(line)[0] for line in synced_lines] == ends
    assert [parse(line)[2]["loss"] for line in synced_lines] == [f"{v:.4f}" for v in across]
    unsynced_lines = [line for line in lines if not parse(line)[3]]
    assert [parse(line)[2]["loss"] for line in unsynced_lines] == [
        f"{mean([s['loss'] for s in group]):.4f}" for group in intervals(results[0]["steps"], [2, 4, 6, 7])
    ]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_gloo_ranks_with_different_record_keys_raise_on_both_ranks(tmp_path: Path) -> None:
    results, _ = run_two_ranks(tmp_path, "keys")
    for result in results:
        assert "ranks averaged different keys" in result["error"]
        assert "step 2" in result["error"]
        assert result["logs"] == []
        assert result["calls"] == {"broadcast": 1, "all_reduce": 1}  # the run id broadcast, then the sync


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", choices=("sync", "keys"), required=True)
    arguments = parser.parse_args()
    _child(arguments.child, arguments.port, arguments.out, arguments.scenario)


def test_progress_param_group_keys_show_each_groups_values_by_name_or_index(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Named(TinyTrainer):
        def build_optimizer(self) -> torch.optim.Optimizer:
            assert self.model is not None
            model: Any = self.model
            groups = [{"params": [model.weight], "name": "w"}, {"params": [model.bias], "lr": 0.01}]
            return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    hook = ProgressHook(interval=1, param_group_keys=("name", "lr", "momentum"))
    Named(workspace=None, max_steps=1, hooks=[hook]).train()
    (line,) = printed(capsys)
    main = parse(line)[2]
    assert [k for k in main if k not in ("step", "data", "eta", "loss")] == ["lr_w", "momentum_w", "lr_1", "momentum_1"]
    assert (main["lr_w"], main["momentum_w"], main["lr_1"]) == ("1.00e-01", "9.00e-01", "1.00e-02")
