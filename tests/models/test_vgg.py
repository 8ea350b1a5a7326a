"""Tests of the VGG family (pipeswap.models.vgg)."""

import torch
from torch import nn

from pipeswap.models import build_model


def test_vgg16_has_one_layer_per_weight_layer() -> None:
    model = build_model("vgg16", device="meta")
    assert model.layer_names == [
        "conv1_1",
        "conv1_2",
        "conv2_1",
        "conv2_2",
        "conv3_1",
        "conv3_2",
        "conv3_3",
        "conv4_1",
        "conv4_2",
        "conv4_3",
        "conv5_1",
        "conv5_2",
        "conv5_3",
        "fc6",
        "fc7",
        "fc8",
    ]
    pools = [
        n
        for n, m in model.named_children()
        if any(isinstance(s, nn.MaxPool2d) for s in m.modules())
    ]
    assert pools == ["conv1_2", "conv2_2", "conv3_3", "conv4_3", "conv5_3"]
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_shapes_through_the_stages() -> None:
    model = build_model("vgg16", device="meta")
    x = torch.empty(2, 3, 224, 224, device="meta")
    assert model.stage(0, 2)(x).shape == (2, 64, 112, 112)
    assert model.stage(0, 13)(x).shape == (2, 512, 7, 7)
    assert model.stage(0, 14)(x).shape == (2, 4096)
    assert model(torch.empty(2, 3, 32, 32, device="meta")).shape == (2, 1000)


def test_micro_learns_a_step() -> None:
    model = build_model("vgg-micro")
    images, labels = model.example_batch(8, image_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.loss(model(images), labels)
    before.backward()
    optimizer.step()
    assert model.loss(model(images), labels) < before
