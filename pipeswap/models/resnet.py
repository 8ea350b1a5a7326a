"""ResNet as a LayeredModel: stem, one layer per residual block (layer1_0 ...), head.

ResNet-18/34 use basic blocks, ResNet-50/101/152 bottlenecks with the stride on the 3x3
convolution (the "v1.5" variant whose parameter counts are the published ones). The head
pools adaptively, so any image size works once the stem and strides leave at least 1x1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeswap.models.base import LayeredModel, init_convs_

__all__ = ["ResNetConfig", "ResNetHead", "ResidualBlock", "build_resnet"]


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a ResNet; ``small_stem`` is a 3x3 stride-1 stem without max-pool (CIFAR)."""

    bottleneck: bool
    depths: tuple[int, ...]
    widths: tuple[int, ...]
    num_classes: int
    stem_width: int = 64
    small_stem: bool = False
    in_channels: int = 3


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int) -> list[nn.Module]:
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return [conv, nn.BatchNorm2d(c_out)]


class ResidualBlock(nn.Module):
    """``relu(body(x) + shortcut(x))`` where body is a basic or a bottleneck stack."""

    def __init__(self, c_in: int, width: int, stride: int, *, bottleneck: bool) -> None:
        super().__init__()
        if bottleneck:
            c_out = 4 * width
            body = [
                *_conv_bn(c_in, width, 1, 1),
                nn.ReLU(),
                *_conv_bn(width, width, 3, stride),
                nn.ReLU(),
                *_conv_bn(width, c_out, 1, 1),
            ]
        else:
            c_out = width
            body = [*_conv_bn(c_in, width, 3, stride), nn.ReLU(), *_conv_bn(width, width, 3, 1)]
        self.body = nn.Sequential(*body)
        needs_projection = stride != 1 or c_in != c_out
        self.shortcut = (
            nn.Sequential(*_conv_bn(c_in, c_out, 1, stride)) if needs_projection else None
        )
        self.out_channels = c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        return torch.relu(self.body(x) + identity)


class ResNetHead(nn.Module):
    """Global average pool and the classifier: ``[B, C, H, W]`` -> ``[B, K]``."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(x), 1))


def _stem(config: ResNetConfig) -> nn.Sequential:
    if config.small_stem:
        return nn.Sequential(*_conv_bn(config.in_channels, config.stem_width, 3, 1), nn.ReLU())
    return nn.Sequential(
        *_conv_bn(config.in_channels, config.stem_width, 7, 2),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    )


def build_resnet(name: str, config: ResNetConfig, *, init: bool = True) -> LayeredModel:
    """A ResNet whose every residual block is one layer of the LayeredModel."""
    named: list[tuple[str, nn.Module]] = [("stem", _stem(config))]
    channels = config.stem_width
    for stage, (depth, width) in enumerate(zip(config.depths, config.widths, strict=True)):
        for index in range(depth):
            stride = 2 if stage > 0 and index == 0 else 1
            block = ResidualBlock(channels, width, stride, bottleneck=config.bottleneck)
            channels = block.out_channels
            named.append((f"layer{stage + 1}_{index}", block))
    named.append(("head", ResNetHead(channels, config.num_classes)))
    model = LayeredModel(
        name, named, "classify", num_classes=config.num_classes, in_channels=config.in_channels
    )
    if init:
        init_convs_(model)
    return model
