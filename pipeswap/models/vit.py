"""Vision Transformer as a LayeredModel: embed (patchify + cls + positions), block0.., head.

Position embeddings are sized for ``image_size`` (build argument, default 224). Images of
another size whose sides are multiples of the patch size also work: the patch position
grid is then resized bicubically on each forward, as is usual for fine-tuning ViTs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel
from pipeswap.models.transformer import PreNormBlock, init_transformer_

__all__ = ["ViTConfig", "ViTEmbed", "ViTHead", "build_vit"]

_EPS = 1e-6  # the LayerNorm epsilon of the published ViT checkpoints


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a ViT; ``image_size`` sizes the position embeddings."""

    image_size: int
    patch: int
    hidden: int
    layers: int
    heads: int
    mlp: int
    num_classes: int
    in_channels: int = 3


class ViTEmbed(nn.Module):
    """Images ``[B, C, H, W]`` -> tokens ``[B, 1 + (H/p)(W/p), D]`` (class token first)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.patch = config.patch
        self.grid = config.image_size // config.patch
        self.patchify = nn.Conv2d(
            config.in_channels, config.hidden, config.patch, stride=config.patch
        )
        self.cls = nn.Parameter(torch.zeros(1, 1, config.hidden))
        self.positions = nn.Parameter(torch.zeros(1, 1 + self.grid * self.grid, config.hidden))

    def _positions(self, rows: int, cols: int) -> torch.Tensor:
        if (rows, cols) == (self.grid, self.grid):
            return self.positions
        cls_pos, patch_pos = self.positions[:, :1], self.positions[:, 1:]
        hidden = patch_pos.shape[-1]
        grid = patch_pos.reshape(1, self.grid, self.grid, hidden).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([cls_pos, grid.permute(0, 2, 3, 1).reshape(1, rows * cols, hidden)], 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        height, width = images.shape[-2:]
        if height % self.patch or width % self.patch:
            raise PipeswapError(
                f"image size {height}x{width} is not a multiple of the patch size {self.patch}; "
                f"pass an image_size divisible by {self.patch}"
            )
        patches = self.patchify(images)  # [B, D, H/p, W/p]
        rows, cols = patches.shape[-2:]
        tokens = patches.flatten(2).transpose(1, 2)  # [B, N, D]
        cls = self.cls.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1) + self._positions(rows, cols)


class ViTHead(nn.Module):
    """Final LayerNorm, the class token, the classifier: ``[B, N, D]`` -> ``[B, K]``."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden, eps=_EPS)
        self.fc = nn.Linear(config.hidden, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x[:, 0]))


def build_vit(name: str, config: ViTConfig, *, init: bool = True) -> LayeredModel:
    """A ViT with one LayeredModel layer per transformer block."""
    if config.image_size % config.patch:
        raise PipeswapError(
            f"image_size {config.image_size} is not a multiple of the patch size "
            f"{config.patch}; pick a multiple of {config.patch}"
        )
    embed = ViTEmbed(config)
    blocks = [
        PreNormBlock(config.hidden, config.heads, config.mlp, causal=False, gelu="none", eps=_EPS)
        for _ in range(config.layers)
    ]
    head = ViTHead(config)
    if init:
        for module in (embed, *blocks, head):
            init_transformer_(module)
        nn.init.normal_(embed.positions, std=0.02)
        nn.init.normal_(embed.cls, std=0.02)
    named = [("embed", embed), *((f"block{i}", b) for i, b in enumerate(blocks)), ("head", head)]
    return LayeredModel(
        name, named, "classify", num_classes=config.num_classes, in_channels=config.in_channels
    )
