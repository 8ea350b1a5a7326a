"""GPT-2 as a LayeredModel: embed, block0..blockN-1, head (pre-LN, causal, no dropout)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pipeswap.models.base import LayeredModel
from pipeswap.models.transformer import (
    PositionalEmbed,
    PreNormBlock,
    init_transformer_,
    tie_output_,
)

__all__ = ["GPTConfig", "GPTEmbed", "GPTHead", "build_gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 model; ``context`` is the longest sequence it accepts."""

    vocab_size: int
    context: int
    hidden: int
    layers: int
    heads: int


class GPTEmbed(PositionalEmbed):
    """Token plus learned position embeddings: ids ``[B, T]`` -> ``[B, T, D]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.vocab_size, config.context, config.hidden)


class GPTHead(nn.Module):
    """Final LayerNorm and the language-model projection: ``[B, T, D]`` -> ``[B, T, V]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden, eps=1e-5)
        self.lm = nn.Linear(config.hidden, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def build_gpt(
    name: str, config: GPTConfig, *, tie_embeddings: bool = True, init: bool = True
) -> LayeredModel:
    """A GPT-2 model; with ``tie_embeddings`` the head shares the token embedding matrix."""
    embed = GPTEmbed(config)
    blocks = [
        PreNormBlock(
            config.hidden, config.heads, 4 * config.hidden, causal=True, gelu="tanh", eps=1e-5
        )
        for _ in range(config.layers)
    ]
    head = GPTHead(config)
    if init:
        for module in (embed, *blocks, head):
            init_transformer_(module)
        # GPT-2 scales the residual projections by 1/sqrt(2 * layers) so the residual
        # stream's variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * config.layers)
        for block in blocks:
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, std=residual_std)
    tie_output_(head.lm, embed.tokens, tie=tie_embeddings, init=init)
    named = [("embed", embed), *((f"block{i}", b) for i, b in enumerate(blocks)), ("head", head)]
    return LayeredModel(name, named, "lm", vocab_size=config.vocab_size)
