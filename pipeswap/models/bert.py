"""BERT as a LayeredModel: embed, layer0..layerN-1, head (the MLM head, no dropout).

Task and target: ``"lm"``, logits over the vocabulary at every position, trained on the
same ``(tokens, next tokens)`` batches as GPT (``pipeswap.data.LMDataset``). The encoder
is bidirectional, so the target is visible in its input and the loss falls fast; the
point is a faithful BERT *workload* (shapes, FLOPs, saved tensors) for the systems
experiments, not a pretraining recipe. Masked-LM data would change no tensor shape.

Parameters follow the original checkpoint minus the pooler and next-sentence head (which
the LM loss never uses, so they would be parameters without gradients): token, position
and token-type embeddings, post-LN layers, and the MLM head (dense + GELU + LayerNorm,
decoder tied to the token embeddings, own bias). BERT-large so counts 335.2M: within 1%
of the 336M Megatron-LM reports for the same shape; the 340M of Devlin et al. is a rounded
figure that no variant of the checkpoint reaches within 1% (with pooler: 336.2M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeswap.models.base import LayeredModel
from pipeswap.models.transformer import (
    PositionalEmbed,
    PostNormBlock,
    init_transformer_,
    tie_output_,
)

__all__ = ["BertConfig", "BertEmbed", "BertHead", "build_bert"]

_EPS = 1e-12  # BERT's LayerNorm epsilon


@dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT encoder; ``max_positions`` is the longest sequence it accepts."""

    vocab_size: int
    max_positions: int
    hidden: int
    layers: int
    heads: int
    intermediate: int


class BertEmbed(PositionalEmbed):
    """Token + position + token-type (all type 0) embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config.vocab_size, config.max_positions, config.hidden)
        self.token_types = nn.Embedding(2, config.hidden)
        self.ln = nn.LayerNorm(config.hidden, eps=_EPS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ln(super().forward(ids) + self.token_types.weight[0])


class BertHead(nn.Module):
    """MLM head: dense -> GELU -> LayerNorm -> vocabulary projection, ``[B,T,D] -> [B,T,V]``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.act = nn.GELU()
        self.ln = nn.LayerNorm(config.hidden, eps=_EPS)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(self.act(self.dense(x))))


def build_bert(
    name: str, config: BertConfig, *, tie_embeddings: bool = True, init: bool = True
) -> LayeredModel:
    """A BERT encoder with its MLM head; ``tie_embeddings`` shares the decoder weight."""
    embed = BertEmbed(config)
    layers = [
        PostNormBlock(config.hidden, config.heads, config.intermediate, gelu="none", eps=_EPS)
        for _ in range(config.layers)
    ]
    head = BertHead(config)
    if init:
        for module in (embed, *layers, head):
            init_transformer_(module)
    tie_output_(head.decoder, embed.tokens, tie=tie_embeddings, init=init)
    named = [("embed", embed), *((f"layer{i}", m) for i, m in enumerate(layers)), ("head", head)]
    return LayeredModel(name, named, "lm", vocab_size=config.vocab_size)
