"""pipeswap/user_images.py: a user's folder of class folders as classification batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeswap.cli import main
from pipeswap.config_fields import ConfigError
from pipeswap.data import dataset_for
from pipeswap.errors import PipeswapError
from pipeswap.user_images import ImageFolderDataset

CLASSES = ("cat", "dog", "fish")


def _folder(root: Path, per_class: int = 20) -> Path:
    """Per class, images of one colour (sizes vary): a task a model can learn."""
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((20 + i % 4, 28, 3), 30, dtype=np.uint8)
            pixels[..., label] = 220
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")
    return root


def test_classes_are_the_sorted_folders_and_images_come_resized_in_0_1(tmp_path: Path) -> None:
    data = ImageFolderDataset(str(_folder(tmp_path / "d")), 16, num_classes=5, split="all")
    assert data.classes == list(CLASSES) and len(data.items) == 60
    images, labels = data.batch(6, 0)
    assert images.shape == (6, 3, 16, 16) and images.dtype == torch.float32
    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
    for image, label in zip(images, labels):  # the class's colour is the bright channel
        assert int(image.mean(dim=(1, 2)).argmax()) == int(label)


def test_the_held_out_images_are_spread_over_every_class_and_never_trained_on(
    tmp_path: Path,
) -> None:
    root = str(_folder(tmp_path / "d"))
    train = ImageFolderDataset(root, 16, num_classes=3, split="train")
    held = ImageFolderDataset(root, 16, num_classes=3, split="val")
    assert len(held.items) == 3 and len(train.items) == 57  # 5% of 60
    assert not set(held.items) & set(train.items)
    assert {label for _, label in held.items} == {0, 1, 2}


def test_an_epoch_visits_every_image_once(tmp_path: Path) -> None:
    data = ImageFolderDataset(str(_folder(tmp_path / "d")), 8, num_classes=3, split="all")
    seen = [int(i) for b in range(6) for i in data.order.chosen(10, b)]
    assert sorted(seen) == list(range(60))


def test_a_model_directory_s_normalization_is_applied(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    norm = {"do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.25] * 3}
    (model / "preprocessor_config.json").write_text(json.dumps(norm))
    root = str(_folder(tmp_path / "d"))
    plain = ImageFolderDataset(root, 8, num_classes=3, split="all").batch(4, 0)[0]
    normed = ImageFolderDataset(root, 8, num_classes=3, split="all", model_dir=str(model))
    assert torch.allclose(normed.batch(4, 0)[0], (plain - 0.5) / 0.25)
    # One number for every channel, as transformers' ViTImageProcessor(image_mean=0.5) saves it.
    (model / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": 0.5, "image_std": 0.25})
    )
    scalar = ImageFolderDataset(root, 8, num_classes=3, split="all", model_dir=str(model))
    assert torch.equal(scalar.batch(4, 0)[0], normed.batch(4, 0)[0])
    (model / "preprocessor_config.json").write_text(json.dumps({"image_mean": "x", "image_std": 1}))
    with pytest.raises(PipeswapError, match="image_mean is 'x'; give a number, or one per channel"):
        ImageFolderDataset(root, 8, num_classes=3, split="all", model_dir=str(model))


def test_bad_image_folders_are_refused_naming_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(ConfigError, match="one sub-folder of images per class"):
        ImageFolderDataset(str(tmp_path / "file.png"), 8, num_classes=3)
    (tmp_path / "one" / "cat").mkdir(parents=True)
    with pytest.raises(ConfigError, match="has 1 class folder"):
        ImageFolderDataset(str(tmp_path / "one"), 8, num_classes=3)
    root = _folder(tmp_path / "d", per_class=2)
    (root / "empty").mkdir()
    with pytest.raises(ConfigError, match="class folder 'empty' holds no images"):
        ImageFolderDataset(str(root), 8, num_classes=5)
    with pytest.raises(ConfigError, match="has 4 class folders, but the model has 3"):
        ImageFolderDataset(str(root), 8, num_classes=3)
    (root / "empty" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(PipeswapError, match="cannot read image .*broken.png"):
        ImageFolderDataset(str(root), 8, num_classes=5, split="all").batch(7, 0)


@pytest.mark.parametrize(
    "first,second",
    [
        (["--nproc", "2"], ["--nproc", "2", "--swap-policy", "hybrid"]),  # swap == none
        (["--pipeline", "2", "--emulate"], ["--pipeline", "2", "--nproc", "2"]),  # == runtime
    ],
)
def test_image_models_train_on_a_folder_in_every_mode(
    tmp_path: Path, first: list[str], second: list[str]
) -> None:
    root = str(_folder(tmp_path / "d", per_class=30))  # 4 of 90 images held out
    argv = ["train", "--model", "resnet-micro", "--batch", "4", "--steps", "4", "--data", root]
    reports = []
    for index, mode in enumerate((first, second)):
        report = tmp_path / f"{index}.json"
        assert main([*argv, *mode, "--report", str(report)]) == 0
        reports.append(json.loads(report.read_text()))
    assert reports[0]["params_sha256"] == reports[1]["params_sha256"]
    assert reports[0]["eval"] == reports[1]["eval"]
    assert 0.0 <= reports[0]["eval"]["accuracy"] <= 1.0


def test_the_data_is_checked_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(_folder(tmp_path / "d", per_class=2))
    argv = ["train", "--model", "resnet-micro", "--batch", "8", "--steps", "1", "--data", root]
    assert main(argv) == 2
    assert "has 5 images, fewer than a batch of 8" in capsys.readouterr().err
    assert dataset_for("resnet-micro", data=(root, "text", "all")).classes == list(CLASSES)
