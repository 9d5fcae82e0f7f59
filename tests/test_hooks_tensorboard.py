"""TensorBoardHook: scalars and images read back from the event files with TensorBoard's own reader."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer
from trainfsm import BaseHook, CheckpointingHook
from trainfsm.hooks.tensorboard import TensorBoardHook

pytest.importorskip("tensorboard")
Image = pytest.importorskip("PIL.Image")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows it: files in order, purges applied."""
    accumulator = EventAccumulator(str(path))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def tags(path: Path) -> dict[str, list[str]]:
    accumulator = EventAccumulator(str(path))
    accumulator.Reload()
    found = accumulator.Tags()
    return {"scalars": sorted(found["scalars"]), "images": sorted(found["images"])}


class LogEveryStep(BaseHook):
    def __init__(self, images: dict[int, dict[str, Any]] | None = None) -> None:
        self.images = images or {}

    def on_after_step(self, trainer: Any) -> None:
        trainer.log({"loss": trainer.step_info["loss"][-1], "m": {"twice": trainer.step * 2}})
        if trainer.step in self.images:
            trainer.log_images(self.images[trainer.step])


def f32(value: float) -> float:
    """TensorBoard stores scalars as float32."""
    return float(torch.tensor(value, dtype=torch.float32))


def test_scalars_land_at_the_trainers_steps_with_nested_keys_joined(tmp_path: Path) -> None:
    trainer = TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[LogEveryStep(), TensorBoardHook()])
    trainer.train()
    log_dir = tmp_path / "tensorboard"
    assert tags(log_dir) == {"scalars": ["loss", "m/twice"], "images": []}
    assert scalars(log_dir, "loss") == [(step, f32(loss)) for step, loss in enumerate(trainer.losses, 1)]
    assert scalars(log_dir, "m/twice") == [(1, 2.0), (2, 4.0), (3, 6.0)]


def test_a_resumed_run_purges_the_steps_logged_after_its_checkpoint(tmp_path: Path) -> None:
    """Attempt 1 checkpoints at step 3, logs steps 4 and 5, then fails in step 6. Attempt 2 resumes
    from step 3 and logs 4..6 again: TensorBoard shows each step once, with attempt 2's values."""

    def attempt(**kwargs: Any) -> TinyTrainer:
        hooks = [CheckpointingHook(interval=3), LogEveryStep(), TensorBoardHook()]
        return TinyTrainer(max_steps=6, workspace=tmp_path, hooks=hooks, **kwargs)

    first = attempt(script={6: RuntimeError("killed")})
    with pytest.raises(RuntimeError, match="killed"):
        first.train()
    (first_file,) = (tmp_path / "tensorboard").iterdir()
    assert [step for step, _ in scalars(first_file, "loss")] == [1, 2, 3, 4, 5]
    second = attempt()
    second.train()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    reference = TinyTrainer(max_steps=6)
    reference.train()

    logged = scalars(tmp_path / "tensorboard", "loss")
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6]  # 4 and 5 once, not twice
    assert logged == [(step, f32(loss)) for step, loss in enumerate(reference.losses, 1)]
    assert logged[3:] == [(step, f32(loss)) for step, loss in enumerate(second.losses, 4)]


def test_images_keep_their_exact_pixels(tmp_path: Path) -> None:
    chw = torch.tensor([[[0.0, 1.0]], [[51 / 255, 0.4]], [[1 / 255, 128 / 255]]])  # (C=3, H=1, W=2)
    gray = torch.tensor([[0, 7], [200, 255]], dtype=torch.uint8)
    rgba = Image.new("RGBA", (1, 1), (1, 2, 3, 4))
    images = {2: {"chw": chw, "nested": {"gray": gray}, "rgba": rgba}}
    TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[LogEveryStep(images), TensorBoardHook("tb")]).train()
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["images"]) == ["chw", "nested/gray", "rgba"]

    def decoded(tag: str) -> tuple[int, str, bytes]:
        (event,) = accumulator.Images(tag)
        with Image.open(io.BytesIO(event.encoded_image_string)) as image:
            return event.step, image.mode, image.tobytes()

    assert decoded("chw") == (2, "RGB", bytes([0, 51, 1, 255, 102, 128]))
    # torch's SummaryWriter stores a grayscale image as RGB, each value three times
    assert decoded("nested/gray") == (2, "RGB", bytes([0, 0, 0, 7, 7, 7, 200, 200, 200, 255, 255, 255]))
    assert decoded("rgba") == (2, "RGBA", bytes([1, 2, 3, 4]))


def test_non_numbers_are_skipped_with_one_warning_per_key_and_dry_run_logs_nothing(tmp_path: Path) -> None:
    class Log(BaseHook):
        def on_after_step(self, trainer: Any) -> None:
            trainer.log({"text": "hello", "vector": torch.ones(3), "ok": 1.5})
            trainer.log({"dry": 1.0}, dry_run=True)

    trainer = TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[Log(), TensorBoardHook()])
    with pytest.warns(RuntimeWarning) as caught:
        trainer.train()
    messages = sorted(str(w.message) for w in caught if "TensorBoardHook" in str(w.message))
    assert messages == [
        "TensorBoardHook logs numbers as scalars; 'text' is a str and is skipped.",
        "TensorBoardHook logs numbers as scalars; 'vector' is a Tensor and is skipped.",
    ]
    assert tags(tmp_path / "tensorboard") == {"scalars": ["ok"], "images": []}
    assert scalars(tmp_path / "tensorboard", "ok") == [(1, 1.5), (2, 1.5)]


def test_log_dir_placement(tmp_path: Path) -> None:
    hook = TensorBoardHook("runs/tb")
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path / "ws", hooks=[LogEveryStep(), hook])
    trainer.train()
    assert hook.resolved_log_dir(trainer) == tmp_path / "ws" / "runs" / "tb"
    assert [step for step, _ in scalars(tmp_path / "ws" / "runs" / "tb", "loss")] == [1]
    absolute = TensorBoardHook(tmp_path / "abs")
    assert absolute.resolved_log_dir(trainer) == tmp_path / "abs"
    without = TinyTrainer(max_steps=1, workspace=None, hooks=[TensorBoardHook()])
    with pytest.raises(ValueError, match="needs a log_dir, or a trainer workspace"):
        without.train()


def test_rank_1_does_nothing(tmp_path: Path) -> None:
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=1, world_size=2, store=fake_pg.FakeStore())
    try:
        hook = TensorBoardHook()
        images = {1: {"i": Image.new("L", (1, 1))}}
        trainer = TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[LogEveryStep(images), hook])
        trainer.train()
    finally:
        dist.destroy_process_group()
    assert trainer.rank == 1 and hook.writer is None
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_dir": 3}, TypeError, "log_dir must be a non-empty str or path, or None"),
        ({"log_dir": ""}, TypeError, "log_dir must be a non-empty str or path, or None"),
        ({"flush_secs": 0}, ValueError, "flush_secs must be a number of seconds > 0"),
        ({"max_queue": 0}, ValueError, "max_queue must be an int >= 1"),
    ],
)
def test_bad_arguments_name_the_argument_and_what_is_allowed(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TensorBoardHook(**kwargs)


def test_without_tensorboard_installed_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[TensorBoardHook()])
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` sees where it is missing
        with pytest.raises(ImportError, match=r"pip install 'trainfsm\[tensorboard\]'"):
            trainer.train()


def test_logging_hooks_records_become_train_tags(tmp_path: Path) -> None:
    from trainfsm import LoggingHook

    trainer = TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[LoggingHook(interval=1), TensorBoardHook()])
    trainer.train()
    found = tags(tmp_path / "tensorboard")["scalars"]
    assert found == sorted(
        [
            "train/loss",
            "train/m/batch",
            "train/data_time",
            "train/step_time",
            "train/non_finite_grad_retry_count",
            "train/lr/group_0",
        ]
    )
    assert scalars(tmp_path / "tensorboard", "train/lr/group_0") == [(1, f32(trainer.lr)), (2, f32(trainer.lr))]


def test_namespace_separator_joins_all_but_the_leaf(tmp_path: Path) -> None:
    class Log(BaseHook):
        def on_after_step(self, trainer: Any) -> None:
            trainer.log(
                {"loss": {"train": 1.0, "val.Hypersim": 2.0}, "criterion": {"global": {"loss": {"train": 3.0}}}}
            )

    hook = TensorBoardHook(namespace_separator=".")
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[Log(), hook]).train()
    assert tags(tmp_path / "tensorboard")["scalars"] == sorted(
        ["loss/train", "loss/val.Hypersim", "criterion.global.loss/train"]
    )


def test_texts_are_written_once_at_the_start(tmp_path: Path) -> None:
    hook = TensorBoardHook(texts={"config": {"lr": 0.1}, "command": "train.py --steps 2"})
    TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[hook]).train()
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    accumulator.Reload()
    texts = {tag: accumulator.Tensors(tag) for tag in accumulator.Tags()["tensors"]}
    assert sorted(texts) == ["command/text_summary", "config/text_summary"]
    (event,) = texts["command/text_summary"]
    assert event.step == 0
    assert event.tensor_proto.string_val == [b"train.py --steps 2"]
    assert texts["config/text_summary"][0].tensor_proto.string_val == [str({"lr": 0.1}).encode()]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"namespace_separator": ""}, "namespace_separator must be a non-empty str"), ({"texts": ["a"]}, "texts must be")],
)
def test_bad_separator_or_texts_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        TensorBoardHook(**kwargs)
