"""Tests of the ResNet family (pipeswap.models.resnet).

Covers: pipeswap/models/resnet.py.
"""

import pytest
import torch

from pipeswap.models import build_model


def test_block_names_and_channels() -> None:
    model = build_model("resnet50", device="meta")
    names = model.layer_names
    assert names[:4] == ["stem", "layer1_0", "layer1_1", "layer1_2"]
    assert names[-2:] == ["layer4_2", "head"]
    x = torch.empty(2, 3, 224, 224, device="meta")
    sizes = {}
    for name, block in model.named_children():
        x = block(x)
        sizes[name] = tuple(x.shape)
    assert sizes["stem"] == (2, 64, 56, 56)
    assert sizes["layer1_2"] == (2, 256, 56, 56)  # bottleneck: 4 x width
    assert sizes["layer4_2"] == (2, 2048, 7, 7)
    assert sizes["head"] == (2, 1000)


def test_basic_blocks_in_resnet18() -> None:
    model = build_model("resnet18", device="meta")
    assert len(model.layer1_0.body) == 5  # conv-bn-relu-conv-bn
    assert model.layer1_0.shortcut is None and model.layer2_0.shortcut is not None


@pytest.mark.parametrize("size", [32, 40, 64])
def test_any_image_size(size: int) -> None:
    model = build_model("resnet-micro")
    images, labels = model.example_batch(3, image_size=size)
    assert model(images).shape == (3, 10)
    big = build_model("resnet152", device="meta")
    assert big(torch.empty(2, 3, size, size, device="meta")).shape == (2, 1000)
