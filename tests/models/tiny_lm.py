"""A user's plain language model (not a zoo model, not Hugging Face), for the adapter tests."""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x)) * scale


class TinyLM(nn.Module):
    """Embedding, repeated blocks given a tensor computed from the input, a head."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 256)
        self.skip = skip

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        scale = (ids[..., None] % 3 + 1).float() / 3
        first = h
        for block in self.blocks:
            h = block(h, scale)
            if self.skip:
                h = h + first
        return self.out(self.norm(h))


def tiny_lm() -> nn.Module:
    """``module:function`` form: ``tests.models.tiny_lm:tiny_lm``."""
    return TinyLM()
