"""A user's image folder (one sub-folder per class) as classification batches, read offline.

The classes are the sub-folders in sorted order (label 0 is the first), as
torchvision's ImageFolder and Hugging Face's ``imagefolder`` number them. Images are
decoded with Pillow when a batch needs them (so a folder larger than memory trains in
constant memory), converted to RGB (or greyscale for one-channel models), resized to
the run's image size (bilinear) and scaled to [0, 1]; a Hugging Face model directory
whose ``preprocessor_config.json`` normalizes gets its ``image_mean``/``image_std``.
Held out are 5% of the images (at least one), spread evenly over the sorted list so
every class keeps its share; a folder given as held-out data of its own is used whole.
Batches follow pipeswap.user_data's epoch order.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError, first_line
from pipeswap.jsonio import load_json
from pipeswap.user_data import HELD_OUT_FRACTION, EpochOrder
from pipeswap.user_files import check_tree, open_regular

__all__ = ["IMAGE_SUFFIXES", "ImageFolderDataset", "list_images", "normalization"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def list_images(path: str, num_classes: int) -> tuple[list[str], list[tuple[Path, int]]]:
    """The class names and every (image, label) of a class-per-folder directory."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(
            f"{{data}} {path}: an image model trains on a folder with one sub-folder of "
            "images per class; give such a folder"
        )
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        raise ConfigError(
            f"{{data}} {path} has {len(classes)} class folder(s); give a folder with one "
            "sub-folder of images per class, at least two"
        )
    if len(classes) > num_classes:
        raise ConfigError(
            f"{{data}} {path} has {len(classes)} class folders, but the model has "
            f"{num_classes} classes; give a model with at least {len(classes)} labels"
        )
    items: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        files = sorted(
            f
            for f in (root / name).rglob("*")
            if f.suffix.lower() in IMAGE_SUFFIXES and not f.is_dir()
        )
        if not files:
            raise ConfigError(
                f"{{data}} {path}: class folder {name!r} holds no images "
                f"({', '.join(IMAGE_SUFFIXES)}); add some or remove the folder"
            )
        check_tree(root, files)  # a FIFO among them would block the batch that reads it
        items.extend((f, label) for f in files)
    return classes, items


def normalization(model_dir: str | None) -> tuple[list[float], list[float]] | None:
    """The model directory's image mean and std, when its preprocessor normalizes."""
    if model_dir is None or not os.path.isdir(model_dir):
        return None
    config = Path(model_dir) / "preprocessor_config.json"
    if not config.is_file():
        return None
    found = load_json(config)
    if not found.get("do_normalize", True) or "image_mean" not in found:
        return None
    return _per_channel(found, "image_mean", config), _per_channel(found, "image_std", config)


def _per_channel(found: dict[str, object], key: str, config: Path) -> list[float]:
    """A value per channel, or one for every channel (a number, as transformers takes it)."""
    value = found.get(key)
    values = [value] if isinstance(value, int | float) else value
    if not isinstance(values, list) or not values:
        values = None
    elif not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        values = None
    if values is None or (key == "image_std" and 0 in values):
        raise PipeswapError(
            f"{config}: {key} is {value!r}; give a number, or one per channel "
            "([0.5, 0.5, 0.5]), with no zero standard deviation"
        )
    return [float(v) for v in values]


class ImageFolderDataset:
    """``batch(b, index)`` returns ``(images [b, channels, S, S] float32, labels [b] int64)``
    of a user's image folder (module docstring: classes, order and splits)."""

    def __init__(
        self,
        path: str,
        image_size: int,
        *,
        num_classes: int,
        channels: int = 3,
        split: str = "train",
        seed: int = 0,
        model_dir: str | None = None,
    ) -> None:
        if channels not in (1, 3):
            raise ConfigError(
                f"{{data}} {path}: images load as RGB or greyscale, and the model takes "
                f"{channels} channels; train it on the built-in images (drop {{data}})"
            )
        self.classes, items = list_images(path, num_classes)
        if split != "all":
            if len(items) < 2:
                raise ConfigError(
                    f"{{data}} {path} has {len(items)} image; give at least two (one to "
                    "train on, one held out)"
                )
            held = max(1, round(len(items) * HELD_OUT_FRACTION))
            chosen = set(np.linspace(0, len(items) - 1, held).round().astype(int).tolist())
            items = [item for i, item in enumerate(items) if (i in chosen) == (split == "val")]
        self.items, self.image_size, self.channels, self.split = items, image_size, channels, split
        self.norm = normalization(model_dir)
        self.order = EpochOrder(len(items), seed)
        self.where = path

    def batch(self, batch_size: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size > len(self.items):
            raise ConfigError(
                f"the {self.split} split of {self.where} has {len(self.items)} images, fewer "
                f"than a batch of {batch_size}; give more images or lower {{batch}}"
            )
        chosen = [self.items[int(i)] for i in self.order.chosen(batch_size, index)]
        images = torch.stack([self._load(file) for file, _ in chosen])
        if self.norm is not None:
            mean, std = (torch.tensor(v).view(-1, 1, 1) for v in self.norm)
            images = (images - mean) / std
        return images, torch.tensor([label for _, label in chosen], dtype=torch.long)

    def _load(self, file: Path) -> torch.Tensor:
        from PIL import Image  # Pillow comes with matplotlib, a dependency

        try:
            with open_regular(file) as handle, Image.open(handle) as image:
                converted = image.convert("RGB" if self.channels == 3 else "L")
                resized = converted.resize(
                    (self.image_size, self.image_size), Image.Resampling.BILINEAR
                )
        except (OSError, ValueError) as exc:
            raise PipeswapError(
                f"cannot read image {file} ({first_line(exc)}); fix or remove it"
            ) from None
        pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0)
        return pixels.permute(2, 0, 1) if pixels.dim() == 3 else pixels.unsqueeze(0)
