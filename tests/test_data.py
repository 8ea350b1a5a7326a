"""Tests of the offline datasets (pipeswap.data)."""

import time

import pytest
import torch

from pipeswap.data import (
    SHAPE_KINDS,
    ImageDataset,
    LMDataset,
    _split_of,
    _stdlib_sources,
    dataset_for,
    stdlib_corpus,
)
from pipeswap.errors import PipeswapError
from pipeswap.models import build_model


def test_corpus_is_python_source_and_deterministic() -> None:
    corpus = stdlib_corpus(1_000_000)
    assert len(corpus) == 1_000_000
    assert b"def " in corpus and b"import " in corpus
    stdlib_corpus.cache_clear()
    assert stdlib_corpus(1_000_000) == corpus
    assert stdlib_corpus(1000) == corpus[:1000]
    paths = [relative for relative, _ in _stdlib_sources()]
    assert paths == sorted(paths)
    assert not any("site-packages" in p or "/test/" in f"/{p}" for p in paths)


def test_splits_use_disjoint_files() -> None:
    train, val = stdlib_corpus(split="train"), stdlib_corpus(split="val")
    assert len(val) > 100_000 and len(train) > 5 * len(val)
    splits = {_split_of(relative) for relative, _ in _stdlib_sources()}
    assert splits == {"train", "val"}
    with pytest.raises(PipeswapError, match="split"):
        stdlib_corpus(split="test")


def test_lm_batches() -> None:
    data = LMDataset(64)
    tokens, targets = data.batch(8, step=3)
    assert tokens.shape == targets.shape == (8, 64)
    assert tokens.dtype == targets.dtype == torch.int64
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 256
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # targets are the next bytes
    again = LMDataset(64).batch(8, step=3)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], targets)
    assert not torch.equal(data.batch(8, step=4)[0], tokens)
    assert not torch.equal(LMDataset(64, seed=1).batch(8, step=3)[0], tokens)
    assert not torch.equal(LMDataset(64, split="val").batch(8, step=3)[0], tokens)


def test_lm_dataset_checks() -> None:
    with pytest.raises(PipeswapError, match="too few"):
        LMDataset(5000, max_bytes=1000)
    with pytest.raises(PipeswapError, match="split"):
        LMDataset(8, split="dev")


def test_image_batches() -> None:
    data = ImageDataset(32)
    images, labels = data.batch(32, step=0)
    assert images.shape == (32, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (32,) and labels.dtype == torch.int64
    assert 0 <= float(images.min()) and float(images.max()) <= 1
    assert set(labels.tolist()) <= set(range(10))
    again = ImageDataset(32).batch(32, step=0)
    assert torch.equal(again[0], images) and torch.equal(again[1], labels)
    assert not torch.equal(data.batch(32, step=1)[0], images)
    assert not torch.equal(ImageDataset(32, seed=1).batch(32, step=0)[0], images)
    assert not torch.equal(ImageDataset(32, split="val").batch(32, step=0)[0], images)
    gray, _ = ImageDataset(20, num_classes=12, channels=1).batch(4, step=0)
    assert gray.shape == (4, 1, 20, 20)
    with pytest.raises(PipeswapError, match="num_classes"):
        ImageDataset(32, num_classes=len(SHAPE_KINDS) + 1)


@pytest.mark.slow  # a timing bound: meaningful only on an otherwise idle machine
def test_image_batch_is_fast() -> None:
    data = ImageDataset(32)
    data.batch(32, step=0)
    start = time.perf_counter()
    for step in range(10):
        data.batch(32, step)
    assert (time.perf_counter() - start) / 10 < 0.05


def _radial_spectrum(images: torch.Tensor) -> torch.Tensor:
    """Power spectrum by spatial frequency: blind to position, angle and colour."""
    gray = images.mean(1)
    gray = gray - gray.mean((1, 2), keepdim=True)
    power = torch.fft.fftshift(torch.fft.fft2(gray).abs().square(), dim=(-2, -1))
    size = gray.shape[-1]
    axis = (torch.arange(size) - size // 2).float()
    radius = torch.hypot(axis[:, None], axis[None, :]).round().long().clamp(max=size // 2)
    profile = torch.zeros(len(gray), size // 2 + 1).index_add_(
        1, radius.flatten(), power.flatten(1)
    )
    return (profile / profile.sum(1, keepdim=True)).sqrt()


def test_classes_are_learnable() -> None:
    # A nearest-centroid classifier on a crude feature, fitted on train, scored on val,
    # must beat chance (10%) several times over.
    train_images, train_labels = ImageDataset(32).batch(1000, step=0)
    val_images, val_labels = ImageDataset(32, split="val").batch(500, step=0)
    features = _radial_spectrum(train_images)
    centroids = torch.stack([features[train_labels == k].mean(0) for k in range(10)])
    predicted = torch.cdist(_radial_spectrum(val_images), centroids).argmin(1)
    assert (predicted == val_labels).float().mean() > 0.35


def test_dataset_for_models_and_names() -> None:
    lm = dataset_for(build_model("gpt2-micro"), seq_len=16)
    assert isinstance(lm, LMDataset) and lm.seq_len == 16
    assert isinstance(dataset_for("gpt2-tiny"), LMDataset)
    assert dataset_for("gpt2-tiny").seq_len == 128  # the zoo's default_seq_len
    images = dataset_for("resnet50", image_size=64, split="val", seed=3)
    assert isinstance(images, ImageDataset)
    assert (images.num_classes, images.image_size, images.split, images.seed) == (12, 64, "val", 3)
    assert dataset_for(build_model("vit-micro")).image_size == 32
    model = build_model("vgg-micro")
    inputs, labels = dataset_for(model).batch(4, step=0)
    assert model(inputs).shape == (4, 10) and labels.max() < model.num_classes
    with pytest.raises(PipeswapError, match="image model"):
        dataset_for("vgg16", seq_len=8)
    with pytest.raises(PipeswapError, match="language model"):
        dataset_for("gpt2-tiny", image_size=32)
