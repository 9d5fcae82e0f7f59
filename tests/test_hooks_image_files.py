"""ImageFileLoggerHook: the files it writes, read back pixel by pixel."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer
from trainfsm import BaseHook
from trainfsm.hooks.image_files import ImageFileLoggerHook, flatten, to_pil

Image = pytest.importorskip("PIL.Image")
numpy = pytest.importorskip("numpy")


class LogImages(BaseHook):
    def __init__(self, images: dict[int, dict[str, Any]], dry_run: bool = False) -> None:
        self.images, self.dry_run = images, dry_run

    def on_after_step(self, trainer: Any) -> None:
        if trainer.step in self.images:
            trainer.log_images(self.images[trainer.step], dry_run=self.dry_run)


def pixels(path: Path) -> tuple[str, str, tuple[int, int], bytes]:
    with Image.open(path) as image:
        return image.format, image.mode, image.size, image.tobytes()


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_images_go_to_visualizations_step_key_with_exact_pixels(tmp_path: Path) -> None:
    chw = torch.tensor([[[0.0, 1.0]], [[51 / 255, 0.4]], [[1 / 255, 128 / 255]]])  # float CHW in [0, 1]
    hwc = torch.tensor([[[1, 2, 3]], [[4, 5, 6]]], dtype=torch.uint8)  # uint8 HWC, H=2, W=1
    gray = torch.tensor([[0, 7], [200, 255]], dtype=torch.uint8)
    array = numpy.array([[[9, 8, 7, 6]]], dtype=numpy.uint8)  # numpy HWC RGBA
    pil = Image.new("RGB", (3, 1), (10, 20, 30))
    images = {
        2: {"chw": chw, "hwc": hwc, "val": {"gray": gray, "deep": {"array": array}}, "a/b": pil},
        3: {"chw": torch.ones(1, 1, 1)},
    }
    TinyTrainer(max_steps=3, workspace=tmp_path, hooks=[LogImages(images), ImageFileLoggerHook()]).train()
    root = tmp_path / "visualizations"
    assert files(root) == [
        "2/a/b.png",
        "2/chw.png",
        "2/hwc.png",
        "2/val/deep/array.png",
        "2/val/gray.png",
        "3/chw.png",
    ]
    assert pixels(root / "2/chw.png") == ("PNG", "RGB", (2, 1), bytes([0, 51, 1, 255, 102, 128]))
    assert pixels(root / "2/hwc.png") == ("PNG", "RGB", (1, 2), bytes([1, 2, 3, 4, 5, 6]))
    assert pixels(root / "2/val/gray.png") == ("PNG", "L", (2, 2), bytes([0, 7, 200, 255]))
    assert pixels(root / "2/val/deep/array.png") == ("PNG", "RGBA", (1, 1), bytes([9, 8, 7, 6]))
    assert pixels(root / "2/a/b.png") == ("PNG", "RGB", (3, 1), bytes([10, 20, 30] * 3))
    assert pixels(root / "3/chw.png") == ("PNG", "L", (1, 1), bytes([255]))


def test_image_format_may_be_a_callable_of_the_key(tmp_path: Path) -> None:
    rgba = Image.new("RGBA", (2, 2), (255, 0, 0, 128))
    images = {1: {"photo": rgba, "diagram": {"plot": rgba}, "bitmap": rgba}}
    formats = {"photo": "jpg", "diagram/plot": "png", "bitmap": "bmp"}
    hook = ImageFileLoggerHook(image_format=formats.__getitem__)
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogImages(images), hook]).train()
    root = tmp_path / "visualizations" / "1"
    assert files(root) == ["bitmap.bmp", "diagram/plot.png", "photo.jpg"]
    assert pixels(root / "diagram/plot.png") == ("PNG", "RGBA", (2, 2), bytes([255, 0, 0, 128] * 4))
    assert pixels(root / "bitmap.bmp")[::2] == ("BMP", (2, 2))
    image_format, mode, _, _ = pixels(root / "photo.jpg")
    assert (image_format, mode) == ("JPEG", "RGB")  # JPEG has no alpha: converted


def test_a_float_image_is_clamped_and_rounded(tmp_path: Path) -> None:
    values = torch.tensor([[-0.5, 0.0, 0.5, 1.0, 2.0]])  # HW
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogImages({1: {"x": values}}), ImageFileLoggerHook()]).train()
    # 0.5 * 255 = 127.5 rounds half to even: 128
    assert pixels(tmp_path / "visualizations/1/x.png")[3] == bytes([0, 0, 128, 255, 255])


def test_a_step_logged_again_overwrites_its_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    hook = ImageFileLoggerHook()
    first = {1: {"x": Image.new("L", (1, 1), 1)}}
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogImages(first), hook]).train()
    second = {1: {"x": Image.new("L", (1, 1), 2)}}
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogImages(second), ImageFileLoggerHook()]).train()
    assert files(tmp_path / "visualizations") == ["1/x.png"]
    assert pixels(tmp_path / "visualizations/1/x.png")[3] == bytes([2])


def test_dry_run_and_rank_1_write_nothing(tmp_path: Path) -> None:
    import torch.distributed as dist

    images = {1: {"x": Image.new("L", (1, 1))}}
    TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogImages(images, dry_run=True), ImageFileLoggerHook()]).train()
    assert not (tmp_path / "visualizations").exists()
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=1, world_size=2, store=fake_pg.FakeStore())
    try:
        trainer = TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogImages(images), ImageFileLoggerHook()])
        trainer.train()
    finally:
        dist.destroy_process_group()
    assert trainer.rank == 1 and not (tmp_path / "visualizations").exists()


def test_no_workspace_is_an_error_before_the_first_step() -> None:
    trainer = TinyTrainer(max_steps=1, workspace=None, hooks=[ImageFileLoggerHook()])
    with pytest.raises(ValueError, match=r"give the trainer a workspace \(BaseTrainer\(workspace=...\)\)"):
        trainer.train()
    assert trainer.calls == 0


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("not an image", TypeError, "'k' must be a PIL image, a torch tensor or a numpy array; got str"),
        (torch.zeros(2, 5, 5), ValueError, r"shape \(2, 5, 5\); a 3-D image needs 1, 3 or 4 channels"),
        (torch.zeros(1, 1, 1, 1), ValueError, r"shape \(1, 1, 1, 1\); an image is \(H, W\)"),
        (torch.zeros(2, 2, dtype=torch.int64), TypeError, "dtype torch.int64; images must be uint8"),
    ],
)
def test_values_that_are_not_images_are_refused(value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        to_pil(value, "k")


def test_layout_rules_when_both_ends_could_be_channels() -> None:
    tensor = torch.arange(36, dtype=torch.uint8).reshape(3, 4, 3)
    assert to_pil(tensor, "t").size == (3, 4)  # a tensor is CHW: 4 high, 3 wide, RGB
    assert to_pil(tensor.numpy(), "a").size == (4, 3)  # an array is HWC: 3 high, 4 wide, RGB


@pytest.mark.parametrize("key", ["../escape", "a//b", "./x", ""])
def test_keys_that_do_not_make_a_path_under_the_step_directory_are_refused(tmp_path: Path, key: str) -> None:
    trainer = TinyTrainer(
        max_steps=1, workspace=tmp_path, hooks=[LogImages({1: {key: torch.zeros(1, 1)}}), ImageFileLoggerHook()]
    )
    with pytest.raises(ValueError, match="does not make a file path"):
        trainer.train()
    assert not (tmp_path / "escape.png").exists()


@pytest.mark.parametrize(
    ("image_format", "error", "match"),
    [
        ("svg", ValueError, "image_format must be one of 'png', 'jpg', 'jpeg', 'bmp', 'gif', 'tif', 'tiff', 'webp'"),
        (None, TypeError, r"or a callable that takes the key and returns one; got None \(NoneType\)"),
    ],
)
def test_bad_image_format_names_the_allowed_ones(image_format: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ImageFileLoggerHook(image_format=image_format)


def test_a_callable_returning_an_unknown_format_is_refused(tmp_path: Path) -> None:
    hook = ImageFileLoggerHook(image_format=lambda key: "svg")
    trainer = TinyTrainer(max_steps=1, workspace=tmp_path, hooks=[LogImages({1: {"x": torch.zeros(1, 1)}}), hook])
    with pytest.raises(ValueError, match=r"image_format\('x'\) returned 'svg'; it must return one of 'png'"):
        trainer.train()


def test_flatten_joins_nested_keys_and_refuses_non_str_keys() -> None:
    assert list(flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3})) == [("a/b", 1), ("a/c/d", 2), ("e", 3)]
    with pytest.raises(TypeError, match="keys must be str; got 1"):
        list(flatten({1: 2}))  # type: ignore[dict-item]


def test_without_pillow_installed_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "PIL.Image", None)
        with pytest.raises(ImportError, match=r"pip install 'trainfsm\[images\]'"):
            to_pil(torch.zeros(1, 1), "x")
