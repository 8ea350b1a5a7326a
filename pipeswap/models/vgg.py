"""VGG as a LayeredModel: one layer per convolution (conv1_1 ... conv5_3), then fc6, fc7, fc8.

A stage's last convolution carries the stage's max-pool, so VGG-16 has 16 layers and as
many cut points. fc6 starts with an adaptive average pool to ``pooled x pooled`` (7x7 for
VGG-16, as torchvision), so any image size >= 32 works. No dropout (determinism).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pipeswap.models.base import LayeredModel, init_convs_

__all__ = ["VGGConfig", "build_vgg"]


@dataclass(frozen=True)
class VGGConfig:
    """Output channels of each convolution, grouped by stage (a max-pool ends each stage)."""

    stages: tuple[tuple[int, ...], ...]
    fc_width: int
    num_classes: int
    pooled: int = 7
    in_channels: int = 3


def build_vgg(name: str, config: VGGConfig, *, init: bool = True) -> LayeredModel:
    """A VGG network with one LayeredModel layer per convolution and per linear layer."""
    named: list[tuple[str, nn.Module]] = []
    channels = config.in_channels
    for stage, widths in enumerate(config.stages):
        for index, width in enumerate(widths):
            parts: list[nn.Module] = [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            if index == len(widths) - 1:
                parts.append(nn.MaxPool2d(kernel_size=2, stride=2))
            named.append((f"conv{stage + 1}_{index + 1}", nn.Sequential(*parts)))
            channels = width
    flat = channels * config.pooled * config.pooled
    named.append(
        (
            "fc6",
            nn.Sequential(
                nn.AdaptiveAvgPool2d(config.pooled),
                nn.Flatten(1),
                nn.Linear(flat, config.fc_width),
                nn.ReLU(),
            ),
        )
    )
    named.append(("fc7", nn.Sequential(nn.Linear(config.fc_width, config.fc_width), nn.ReLU())))
    named.append(("fc8", nn.Linear(config.fc_width, config.num_classes)))
    model = LayeredModel(
        name, named, "classify", num_classes=config.num_classes, in_channels=config.in_channels
    )
    if init:
        # Kaiming init keeps the activations' scale through 13 un-normalised convolutions.
        # The convolutions all come before fc6, so the random stream runs as in one pass.
        init_convs_(model)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)
    return model
