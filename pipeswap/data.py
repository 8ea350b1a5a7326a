"""Offline datasets: Python's own standard library as byte-level text, procedural images.

Nothing is downloaded. Every batch is a pure function of ``(seed, split, step)``, so a
run can be repeated bit for bit and a pipeline stage can regenerate the batch it needs.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
from pathlib import Path
from typing import Any

import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.models.base import IGNORE_INDEX, LayeredModel
from pipeswap.models.load import names_user_model
from pipeswap.models.registry import build_model, model_names, model_spec
from pipeswap.models.tasks import task_kind
from pipeswap.user_data import TextDataset, load_tokenizer, read_tokens, tokenizer_mask_id
from pipeswap.user_images import ImageFolderDataset

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "SHAPE_KINDS",
    "SPLITS",
    "ImageDataset",
    "LMDataset",
    "MaskedLMDataset",
    "dataset_for",
    "stdlib_corpus",
]

DEFAULT_CORPUS_BYTES = 8 * 2**20
SPLITS = ("train", "val")
# Folders of the standard library that are not its own source (or are test data).
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
SHAPE_KINDS = (
    "disk",
    "square",
    "triangle",
    "ring",
    "cross",
    "stripes",
    "checkerboard",
    "rings",
    "gradient",
    "dots",
    "ellipse",
    "frame",
)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise PipeswapError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")


def _stream_seed(kind: str, seed: int, split: str, step: int) -> int:
    """A 63-bit seed for one batch, stable across processes and Python versions."""
    digest = hashlib.blake2b(f"{kind}/{seed}/{split}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _split_of(relative_path: str) -> str:
    """About one file in ten is validation, chosen by a hash of its path."""
    return "val" if hashlib.blake2b(relative_path.encode()).digest()[0] % 10 == 0 else "train"


@functools.cache
def _stdlib_sources() -> tuple[tuple[str, Path], ...]:
    """The standard library's .py files as (posix relative path, path), sorted by the former."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS]
        for file in files:
            if file.endswith(".py"):
                path = Path(folder) / file
                found.append((path.relative_to(root).as_posix(), path))
    return tuple(sorted(found))


@functools.lru_cache(maxsize=8)
def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, split: str | None = None) -> bytes:
    """The stdlib's .py sources concatenated in sorted path order, cut at ``max_bytes``.

    ``split`` keeps only the files of that split ("train" or "val"); None keeps all.
    The text depends on the Python version (its standard library), nothing else.
    """
    if split is not None:
        _check_split(split)
    if max_bytes <= 0:
        raise PipeswapError(f"max_bytes must be positive, not {max_bytes}")
    parts: list[bytes] = []
    size = 0
    for relative, path in _stdlib_sources():
        if split is not None and _split_of(relative) != split:
            continue
        text = path.read_bytes() + b"\n"
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    if not corpus:
        raise PipeswapError(f"found no Python sources under {sysconfig.get_paths()['stdlib']}")
    return corpus


class LMDataset:
    """Byte-level language modelling on the stdlib corpus (vocabulary 256).

    ``batch(b, step)`` draws ``b`` windows at random offsets of the split's text and
    returns ``(tokens, targets)``, both ``[b, seq_len]`` int64, targets shifted by one.
    Train and val use disjoint files.
    """

    vocab_size = 256

    def __init__(
        self,
        seq_len: int,
        split: str = "train",
        seed: int = 0,
        *,
        max_bytes: int = DEFAULT_CORPUS_BYTES,
    ) -> None:
        _check_split(split)
        if seq_len < 1:
            raise ConfigError(f"{{seq_len}} must be at least 1, not {seq_len}")
        text = stdlib_corpus(max_bytes, split)
        if len(text) < seq_len + 2:
            raise ConfigError(
                f"the {split} corpus has {len(text)} bytes, too few for {{seq_len}} {seq_len}; "
                "raise max_bytes or lower {seq_len}"
            )
        self.seq_len = seq_len
        self.split = split
        self.seed = seed
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def batch(self, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(_stream_seed("lm", self.seed, self.split, step))
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (batch_size,), generator=gen)
        window = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return window[:, :-1], window[:, 1:]  # [B, T] each


class MaskedLMDataset:
    """LMDataset windows for a masked language model (BERT): 15% of each sequence masked.

    ``batch`` returns ``(inputs, targets)``: the tokens with the chosen positions replaced by
    ``mask_token_id``, and the original tokens there with IGNORE_INDEX (-100) elsewhere.
    Every sequence has the same number of masked positions (at least one), so the mean
    loss of a batch equals the mean of its micro-batches' mean losses, as a pipeline
    computes it.
    """

    mask_fraction = 0.15

    def __init__(self, text: LMDataset | TextDataset, mask_token_id: int) -> None:
        self.text = text
        self.mask_token_id = mask_token_id
        self.seq_len = text.seq_len

    def batch(self, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _next = self.text.batch(batch_size, step)
        gen = torch.Generator().manual_seed(
            _stream_seed("mlm", self.text.seed, self.text.split, step)
        )
        count = max(1, round(self.mask_fraction * self.seq_len))
        order = torch.rand(tokens.shape, generator=gen).argsort(dim=1)
        chosen = torch.zeros_like(tokens, dtype=torch.bool)
        chosen.scatter_(1, order[:, :count], True)
        inputs = tokens.masked_fill(chosen, self.mask_token_id)
        targets = tokens.masked_fill(~chosen, IGNORE_INDEX)
        return inputs, targets


def _shape_mask(kind: str, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Coverage in [0, 1] of shape ``kind`` at shape coordinates ``(u, v)`` (unit size)."""
    r = torch.hypot(u, v)
    box = torch.maximum(u.abs(), v.abs())
    wave = 3 * math.pi
    if kind == "disk":
        mask = r < 1
    elif kind == "square":
        mask = box < 0.8
    elif kind == "triangle":  # equilateral, inscribed in the unit circle
        mask = (v > -0.5) & (v < 1 - math.sqrt(3) * u.abs())
    elif kind == "ring":
        mask = (r > 0.6) & (r < 1)
    elif kind == "cross":
        mask = (torch.minimum(u.abs(), v.abs()) < 0.25) & (box < 1)
    elif kind == "stripes":
        mask = torch.sin(wave * u) > 0
    elif kind == "checkerboard":
        mask = torch.sin(wave * u) * torch.sin(wave * v) > 0
    elif kind == "rings":
        mask = torch.sin(wave * r) > 0
    elif kind == "gradient":
        return (0.5 + 0.5 * u).clamp(0, 1)
    elif kind == "dots":
        mask = torch.cos(2 * math.pi * u) + torch.cos(2 * math.pi * v) > 1.2
    elif kind == "ellipse":  # 1 by 0.45: unlike a disk, it shows its angle
        mask = u.square() + (v / 0.45).square() < 1
    elif kind == "frame":
        mask = (box > 0.6) & (box < 1)
    else:
        raise AssertionError(kind)
    return mask.float()


class ImageDataset:
    """Procedural images: one shape kind per class, random place, size, angle and colours.

    ``batch(b, step)`` returns ``(images [b, channels, S, S] float32 in [0, 1],
    labels [b] int64 in [0, num_classes))``; class ``k`` is ``SHAPE_KINDS[k]``. Val
    batches come from a seed stream disjoint from train's.
    """

    def __init__(
        self,
        image_size: int,
        num_classes: int = 10,
        split: str = "train",
        seed: int = 0,
        channels: int = 3,
    ) -> None:
        _check_split(split)
        if not 2 <= num_classes <= len(SHAPE_KINDS):
            raise PipeswapError(
                f"num_classes must be between 2 and {len(SHAPE_KINDS)} (the shape kinds: "
                f"{', '.join(SHAPE_KINDS)}), not {num_classes}"
            )
        if image_size < 8:
            raise ConfigError(f"{{image_size}} must be at least 8 pixels, not {image_size}")
        if channels < 1:
            raise PipeswapError(f"channels must be at least 1, not {channels}")
        self.image_size = image_size
        self.num_classes = num_classes
        self.split = split
        self.seed = seed
        self.channels = channels

    def batch(self, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(_stream_seed("image", self.seed, self.split, step))
        size, channels = self.image_size, self.channels
        labels = torch.randint(0, self.num_classes, (batch_size,), generator=gen)
        centre = (torch.rand(batch_size, 2, generator=gen) - 0.5) * 0.7
        scale = 0.35 + 0.3 * torch.rand(batch_size, generator=gen)
        angle = 2 * math.pi * torch.rand(batch_size, generator=gen)
        background = torch.rand(batch_size, channels, generator=gen)
        # Foreground differs from background by 0.35..0.65 in every channel.
        offset = 0.35 + 0.3 * torch.rand(batch_size, channels, generator=gen)
        foreground = (background + offset) % 1.0
        noise = 0.05 * torch.randn(batch_size, channels, size, size, generator=gen)

        axis = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 2 - 1  # pixel centres
        y, x = torch.meshgrid(axis, axis, indexing="ij")  # [S, S]
        dx = x - centre[:, 0, None, None]  # [B, S, S]
        dy = y - centre[:, 1, None, None]
        cos, sin = torch.cos(angle)[:, None, None], torch.sin(angle)[:, None, None]
        u = (cos * dx + sin * dy) / scale[:, None, None]
        v = (cos * dy - sin * dx) / scale[:, None, None]
        coverage = torch.empty(batch_size, size, size)
        for k in labels.unique().tolist():
            chosen = labels == k
            coverage[chosen] = _shape_mask(SHAPE_KINDS[k], u[chosen], v[chosen])

        fg, bg = foreground[:, :, None, None], background[:, :, None, None]
        images = bg + coverage[:, None] * (fg - bg) + noise
        return images.clamp_(0, 1), labels


def dataset_for(
    model: LayeredModel | str,
    *,
    seq_len: int | None = None,
    image_size: int | None = None,
    split: str = "train",
    seed: int = 0,
    data: tuple[str, str, str] | None = None,
) -> LMDataset | MaskedLMDataset | ImageDataset | TextDataset | ImageFolderDataset:
    """The offline dataset that trains ``model`` (a LayeredModel or a model name).

    Language models get LMDataset (bytes; needs a vocabulary of at least 256), masked ones
    (``mask_token_id`` set) MaskedLMDataset; image models get ImageDataset with
    ``min(model classes, len(SHAPE_KINDS))`` classes. Unset sizes default to the model's
    ``default_seq_len`` / ``default_image_size``. ``data`` (path, text field, part; from
    DataConfig.source) trains on the user's own data instead: a language model on tokens
    or text (pipeswap.user_data), an image model on a folder of class folders
    (pipeswap.user_images); it says which part of the data ``split`` reads.
    """
    if isinstance(model, str) and names_user_model(model, model_names()):
        # A user's model: its task, vocabulary and mask token are read off the model.
        model = build_model(model, device="meta")
    mask_token_id = None
    if isinstance(model, str):
        spec = model_spec(model)
        name, task, vocab, classes, in_channels = (
            spec.name,
            spec.task,
            spec.vocab_size,
            spec.num_classes,
            3,
        )
    else:
        name, task, vocab, classes, in_channels = (
            model.name,
            model.task,
            model.vocab_size,
            model.num_classes,
            model.in_channels,
        )
        mask_token_id = model.mask_token_id
        fixed = model.fixed_image_size
        if task_kind(task).has_image_size and fixed is not None and image_size not in (None, fixed):
            raise ConfigError(
                f"{name} takes {fixed}x{fixed} images (its config's image_size); pass "
                f"{{image_size}} {fixed}"
            )
    entry = task_kind(task)
    if entry.has_seq_len:
        entry.check_sizes(name, seq_len, image_size)
        if data is not None:
            seq_len = seq_len if seq_len is not None else _default(name, "default_seq_len")
            path, text_field, part = data
            tokens = _user_tokens(path, text_field, name)
            own = TextDataset(tokens, seq_len, vocab_size=vocab, split=part, seed=seed, where=path)
            if mask_token_id is None:
                return own
            # Text the directory's tokenizer tokenized is masked with its mask token.
            return MaskedLMDataset(own, _tokenizer_mask(name) or mask_token_id)
        if vocab < LMDataset.vocab_size:
            raise ConfigError(
                f"{name} has a vocabulary of {vocab} tokens, but the built-in byte-level data "
                f"needs {LMDataset.vocab_size} (token ids 0-255): train on your own data "
                f"({{data}}), or set vocab_size to {LMDataset.vocab_size} or more"
            )
        seq_len = seq_len if seq_len is not None else _default(name, "default_seq_len")
        text = LMDataset(seq_len, split=split, seed=seed)
        return text if mask_token_id is None else MaskedLMDataset(text, mask_token_id)
    reads_tokens = model.takes_tokens if not isinstance(model, str) else False
    entry.check_sizes(name, seq_len, image_size, tokens=reads_tokens)
    image_size = image_size if image_size is not None else _default(name, "default_image_size")
    if data is not None:
        path, _, part = data
        return ImageFolderDataset(
            path,
            image_size,
            num_classes=classes,
            channels=in_channels,
            split=part,
            seed=seed,
            model_dir=name,
        )
    num_classes = min(classes, len(SHAPE_KINDS))
    return ImageDataset(image_size, num_classes, split=split, seed=seed, channels=in_channels)


@functools.lru_cache(maxsize=4)
def _user_tokens(path: str, text_field: str, model: str) -> Any:
    """The user's tokens, read once per run (training and held-out splits share them)."""
    return read_tokens(path, text_field, load_tokenizer(model))


@functools.lru_cache(maxsize=4)
def _tokenizer_mask(model: str) -> int | None:
    return tokenizer_mask_id(model)


def _default(name: str, field: str) -> int:
    try:
        value = getattr(model_spec(name), field)
    except PipeswapError:
        value = None
    if value is None:
        what = field.removeprefix("default_")
        raise ConfigError(f"{name} has no default {what}: pass {{{what}}}")
    return int(value)
