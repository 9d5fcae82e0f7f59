"""WandbHook with the real wandb in offline mode (no network, no key): every value is read back from
the run files wandb wrote (``tests/wandb_offline.py``), never from a mock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer, read_events
from tests.wandb_offline import CorruptRunFile, OfflineRun, history, iter_payloads, read_runs
from trainfsm import BaseHook, CheckpointingHook
from trainfsm.hooks.wandb import RUN_ID_FILE, WandbHook

wandb = pytest.importorskip("wandb")
Image = pytest.importorskip("PIL.Image")

USR1 = signal.SIGUSR1


def _wandb_core_children() -> list[str]:
    """Command lines of this process's children that are wandb's service (wandb-core)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and "wandb" in cmdline:
            found.append(cmdline)
    return found


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Offline, silent wandb writing under ``tmp_path/wandb_dir``; the service is torn down after."""
    directory = tmp_path / "wandb_dir"
    directory.mkdir()
    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_NAME", "WANDB_TAGS", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(directory))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # no stdout capture fighting pytest's
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    yield directory
    wandb.teardown()  # ends the wandb-core service process this test started
    assert _wandb_core_children() == []


class LogEveryStep(BaseHook):
    """``trainer.log`` after every step; extras at given steps (a second call, images, dry runs)."""

    def __init__(self, extra: dict[int, dict[str, Any]] | None = None, images: dict[int, dict[str, Any]] | None = None):
        self.extra, self.images = extra or {}, images or {}

    def on_after_step(self, trainer: Any) -> None:
        trainer.log({"loss": trainer.step_info["loss"][-1], "m": {"twice": trainer.step * 2}})
        if trainer.step in self.extra:
            trainer.log(self.extra[trainer.step])
        if trainer.step in self.images:
            trainer.log_images(self.images[trainer.step])


def expected_rows(losses: list[float], first_step: int = 1) -> list[tuple[int, dict[str, Any]]]:
    return [(first_step + i, {"loss": loss, "m/twice": (first_step + i) * 2}) for i, loss in enumerate(losses)]


def only_run(wandb_dir: Path) -> OfflineRun:
    runs = read_runs(wandb_dir)
    assert len(runs) == 1, runs
    return runs[0]


# ---------------------------------------------------------------------------- values and steps
def test_logs_exact_values_at_the_trainers_steps_and_finishes_with_exit_code_0(tmp_path: Path, wandb_dir: Path) -> None:
    hook = WandbHook("trainfsm-tests", name="tiny", config={"lr": 0.1, "opt": {"name": "sgd"}}, tags=["a", "b"])
    extra = {2: {"extra": 7, "text": "hello"}}  # a second log() at step 2 lands in step 2's row
    trainer = TinyTrainer(max_steps=4, workspace=tmp_path / "ws", hooks=[LogEveryStep(extra), hook])
    trainer.train()
    run = only_run(wandb_dir)
    rows = expected_rows(trainer.losses)
    rows[1][1].update(extra=7, text="hello")
    assert run.history == rows
    assert (run.project, run.name, run.tags) == ("trainfsm-tests", "tiny", ["a", "b"])
    assert run.config == {"lr": 0.1, "opt": {"name": "sgd"}}
    assert run.exit_code == 0 and not run.preempting
    assert (tmp_path / "ws" / RUN_ID_FILE).read_text().strip() == run.run_id
    [event] = [e for e in read_events(tmp_path / "ws") if e["event"] == "wandb_run"]
    assert (event["wandb_id"], event["continued"], event["mode"]) == (run.run_id, False, "offline")
    assert hook.run is None and wandb.run is None  # finished at EXIT
    assert _wandb_core_children() == []  # and EXIT waited for wandb's service to write everything


def test_nested_keys_are_joined_with_slashes_and_tensors_become_numbers(tmp_path: Path, wandb_dir: Path) -> None:
    class Log(BaseHook):
        def on_before_train(self, trainer: Any) -> None:
            trainer.log({"val": {"loss": torch.tensor(0.25), "acc": {"top1": 0.5}}, "n": torch.tensor([3])})

    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[WandbHook("p"), Log()]).train()
    assert only_run(wandb_dir).history == [(0, {"val/loss": 0.25, "val/acc/top1": 0.5, "n": 3})]


def test_dry_run_logs_nothing(tmp_path: Path, wandb_dir: Path) -> None:
    class DryRun(BaseHook):
        def on_after_step(self, trainer: Any) -> None:
            trainer.log({"dry": 1.0}, dry_run=True)
            trainer.log_images({"dry_image": Image.new("L", (2, 2))}, dry_run=True)

    trainer = TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[LogEveryStep(), DryRun(), WandbHook("p")])
    trainer.train()
    assert only_run(wandb_dir).history == expected_rows(trainer.losses)


def test_images_are_logged_at_the_step_with_exact_pixels_and_the_chosen_format(tmp_path: Path, wandb_dir: Path) -> None:
    chw = torch.tensor([[[0.0, 1.0]], [[51 / 255, 0.4]], [[1 / 255, 128 / 255]]])  # (C=3, H=1, W=2) in [0, 1]
    pil = Image.new("RGB", (3, 2), (10, 20, 30))
    images = {2: {"chw": chw, "samples": {"pil": pil}, "jpg": pil}}
    hook = WandbHook("p", image_format=lambda key: "jpg" if key == "jpg" else "png")
    trainer = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[LogEveryStep(images=images), hook])
    trainer.train()
    run = only_run(wandb_dir)
    steps = [step for step, _ in run.history]
    assert steps == [1, 2, 3]
    row = run.history[1][1]
    assert row["loss"] == trainer.losses[1]
    keys = ("chw", "samples/pil", "jpg")
    assert {key: (row[key]["_type"], row[key]["format"], row[key]["width"], row[key]["height"]) for key in keys} == {
        "chw": ("image-file", "png", 2, 1),
        "samples/pil": ("image-file", "png", 3, 2),
        "jpg": ("image-file", "jpg", 3, 2),
    }
    with Image.open(run.path / "files" / row["chw"]["path"]) as image:
        assert image.convert("RGB").tobytes() == bytes([0, 51, 1, 255, 102, 128])
    with Image.open(run.path / "files" / row["samples/pil"]["path"]) as image:
        assert image.convert("RGB").tobytes() == bytes([10, 20, 30] * 6)
    with Image.open(run.path / "files" / row["jpg"]["path"]) as image:
        assert image.format == "JPEG"


# ---------------------------------------------------------------------------- every way out
def test_a_failure_finishes_the_run_with_exit_code_1_keeping_every_row(tmp_path: Path, wandb_dir: Path) -> None:
    trainer = TinyTrainer(
        max_steps=5, workspace=tmp_path, script={3: RuntimeError("boom")}, hooks=[LogEveryStep(), WandbHook("p")]
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    run = only_run(wandb_dir)
    assert run.history == expected_rows(trainer.losses)  # steps 1 and 2: the last one only lands at finish
    assert run.exit_code == 1 and not run.preempting


def test_preemption_by_an_exit_signal_finishes_the_run_with_128_plus_signal(tmp_path: Path, wandb_dir: Path) -> None:
    class SignalAt(BaseHook):
        def on_before_step(self, trainer: Any) -> None:
            if trainer.step == 2:
                os.kill(os.getpid(), USR1)  # the machine stops at the end of this step

    trainer = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[LogEveryStep(), SignalAt(), WandbHook("p")])
    trainer.set_exit_signals([USR1])
    with pytest.raises(SystemExit) as info:
        trainer.train()
    assert info.value.code == 128 + USR1
    run = only_run(wandb_dir)
    assert run.history == expected_rows(trainer.losses) and len(run.history) == 2
    assert run.exit_code == 128 + USR1 and run.preempting


def test_a_preempted_then_resumed_trainer_continues_the_same_run(tmp_path: Path, wandb_dir: Path) -> None:
    """Attempt 1 is preempted at step 3 (checkpoint, exit 138); attempt 2, launched in the same
    workspace, resumes from the checkpoint and logs steps 4 and 5 into the same wandb run."""

    class SignalAt(BaseHook):
        def on_before_step(self, trainer: Any) -> None:
            if trainer.step == 3:
                os.kill(os.getpid(), USR1)

    def attempt(*hooks: BaseHook) -> TinyTrainer:
        checkpoint = CheckpointingHook(interval=100, exit_signals=[USR1])
        return TinyTrainer(max_steps=5, workspace=tmp_path / "ws", hooks=[checkpoint, LogEveryStep(), *hooks])

    first = attempt(SignalAt(), WandbHook("p"))
    with pytest.raises(SystemExit) as info:
        first.train()
    assert info.value.code == 128 + USR1
    second = attempt(WandbHook("p"))
    second.train()
    reference = TinyTrainer(max_steps=5)
    reference.train()

    runs = read_runs(wandb_dir)
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id  # one wandb run, two attempts
    assert runs[0].path != runs[1].path
    assert (runs[0].exit_code, runs[0].preempting) == (128 + USR1, True)
    assert (runs[1].exit_code, runs[1].preempting) == (0, False)
    assert [step for step, _ in runs[0].history] == [1, 2, 3]
    assert [step for step, _ in runs[1].history] == [4, 5]
    assert history(runs) == expected_rows(reference.losses)  # exact resume: the same values as no interruption
    assert (tmp_path / "ws" / RUN_ID_FILE).read_text().strip() == runs[0].run_id
    continued = [e["continued"] for e in read_events(tmp_path / "ws") if e["event"] == "wandb_run"]
    assert continued == [False, True]


# ---------------------------------------------------------------------------- environment and ranks
def test_without_wandb_dir_the_files_go_to_the_workspace_and_wandb_run_id_is_honoured(
    tmp_path: Path, wandb_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_DIR")
    monkeypatch.setenv("WANDB_RUN_ID", "fromenv123")
    trainer = TinyTrainer(max_steps=2, workspace=tmp_path / "ws", hooks=[LogEveryStep(), WandbHook("p")])
    trainer.train()
    assert list(wandb_dir.iterdir()) == []
    run = only_run(tmp_path / "ws")
    assert run.run_id == "fromenv123" and run.history == expected_rows(trainer.losses)
    assert (tmp_path / "ws" / RUN_ID_FILE).read_text().strip() == "fromenv123"


def test_an_explicit_id_and_wandb_kwargs_go_to_wandb_init(tmp_path: Path, wandb_dir: Path) -> None:
    (tmp_path / RUN_ID_FILE).parent.mkdir(parents=True)
    (tmp_path / RUN_ID_FILE).write_text("stored1\n")
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[WandbHook("p", id="explicit1", notes="n")]).train()
    assert only_run(wandb_dir).run_id == "explicit1"
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == "explicit1"


def test_wandb_mode_disabled_is_honoured(tmp_path: Path, wandb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    images = {1: {"x": torch.zeros(1, 1)}}
    TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[LogEveryStep(images=images), WandbHook("p")]).train()
    assert list(wandb_dir.iterdir()) == [] and not (tmp_path / "wandb").exists()  # no files, no id kept
    [event] = [e for e in read_events(tmp_path) if e["event"] == "wandb_run"]
    assert event["mode"] == "disabled"


def test_rank_1_does_nothing(tmp_path: Path, wandb_dir: Path) -> None:
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=1, world_size=2, store=fake_pg.FakeStore())
    try:
        hook = WandbHook("p")
        trainer = TinyTrainer(
            max_steps=2, workspace=tmp_path, hooks=[LogEveryStep(images={1: {"i": Image.new("L", (1, 1))}}), hook]
        )
        trainer.train()
    finally:
        dist.destroy_process_group()
    assert trainer.rank == 1
    assert hook.run is None and wandb.run is None
    assert list(wandb_dir.iterdir()) == [] and not (tmp_path / "wandb").exists()
    assert _wandb_core_children() == []


def test_logging_after_train_warns_and_drops_the_records(tmp_path: Path, wandb_dir: Path) -> None:
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogEveryStep(), WandbHook("p")])
    trainer.train()
    with pytest.warns(RuntimeWarning, match="finished at EXIT"):
        trainer.log({"late": 1.0})
    assert only_run(wandb_dir).history == expected_rows(trainer.losses)


# ---------------------------------------------------------------------------- arguments
def test_config_may_be_a_json_file(tmp_path: Path, wandb_dir: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"lr": 0.01, "layers": [1, 2]}))
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[WandbHook("p", config=path)]).train()
    assert only_run(wandb_dir).config == {"lr": 0.01, "layers": [1, 2]}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"project": 3}, TypeError, "project must be a non-empty str or None"),
        ({"project": "p", "name": ""}, TypeError, "name must be a non-empty str or None"),
        ({"project": "p", "tags": "a,b"}, TypeError, "tags must be a list of str or None"),
        ({"project": "p", "config": 3}, TypeError, "config must be a dict, the path of a JSON file, or None"),
        ({"project": "p", "config": "/nonexistent/config.json"}, ValueError, "cannot read the JSON file"),
        ({"project": "p", "image_format": "tiff"}, ValueError, "'png', 'jpg', 'jpeg', 'bmp'"),
        ({"project": "p", "image_format": 3}, TypeError, "image_format must be one of"),
        ({"project": "p", "id": 5}, TypeError, "id must be a non-empty str or None"),
    ],
)
def test_bad_arguments_name_the_argument_and_what_is_allowed(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        WandbHook(**kwargs)


def test_a_json_config_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object; it holds list"):
        WandbHook("p", config=tmp_path / "c.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        WandbHook("p", config=tmp_path / "bad.json")


def test_a_callable_image_format_must_return_an_allowed_format(tmp_path: Path, wandb_dir: Path) -> None:
    images = {1: {"x": Image.new("L", (1, 1))}}
    trainer = TinyTrainer(
        max_steps=1, workspace=tmp_path, hooks=[LogEveryStep(images=images), WandbHook("p", image_format=str.upper)]
    )
    with pytest.raises(ValueError, match=r"image_format\('x'\) returned 'X'; it must return one of 'png'"):
        trainer.train()
    assert only_run(wandb_dir).exit_code == 1


# ---------------------------------------------------------------------------- import and the reader
def test_without_wandb_installed_the_error_names_the_extra(
    tmp_path: Path, wandb_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[WandbHook("p")])
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees where it is not installed
        with pytest.raises(ImportError, match=r"pip install 'trainfsm\[wandb\]'"):
            trainer.train()


def test_importing_the_hook_does_not_import_wandb() -> None:
    code = "import sys, trainfsm.hooks.wandb; print('wandb' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_the_reader_checks_header_and_checksums(tmp_path: Path, wandb_dir: Path) -> None:
    trainer = TinyTrainer(
        max_steps=2, workspace=tmp_path, hooks=[LogEveryStep({1: {"big": "x" * 70_000}}), WandbHook("p")]
    )
    trainer.train()
    run = only_run(wandb_dir)  # a 70 kB row spans three blocks: FIRST, MIDDLE, LAST fragments
    assert run.history[0][1]["big"] == "x" * 70_000 and [step for step, _ in run.history] == [1, 2]
    data = next(run.path.glob("run-*.wandb")).read_bytes()
    assert len(data) > 2 * 32 * 1024
    with pytest.raises(CorruptRunFile, match="header"):
        list(iter_payloads(b"LEVELDB" + data[7:]))
    flipped = bytearray(data)
    flipped[100] ^= 0xFF
    with pytest.raises(CorruptRunFile, match="checksum"):
        list(iter_payloads(bytes(flipped)))
    with pytest.raises(CorruptRunFile):
        list(iter_payloads(data[: len(data) - 3]))


def test_logging_hooks_records_land_under_trainloops_keys(tmp_path: Path, wandb_dir: Path) -> None:
    from trainfsm import LoggingHook

    trainer = TinyTrainer(max_steps=4, workspace=tmp_path / "ws", hooks=[LoggingHook(interval=2), WandbHook("t")])
    trainer.train()
    run = only_run(wandb_dir)
    assert [step for step, _ in run.history] == [2, 4]
    keys = set(run.history[0][1])
    assert keys == {
        "train/loss",
        "train/m/batch",
        "train/data_time",
        "train/step_time",
        "train/non_finite_grad_retry_count",
        "train/lr/group_0",
    }
    assert run.history[1][1]["train/lr/group_0"] == trainer.lr
    assert run.history[1][1]["train/m/batch"] == 2.5  # batches 2 and 3
