"""Transformer parts shared by the GPT, BERT and ViT families: attention, MLP, blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeswap.errors import PipeswapError

__all__ = [
    "MLP",
    "PositionalEmbed",
    "PostNormBlock",
    "PreNormBlock",
    "SelfAttention",
    "init_transformer_",
    "tie_output_",
]


class PositionalEmbed(nn.Module):
    """Token plus learned position embeddings, ids ``[B, T]`` -> ``[B, T, D]``: GPT-2's
    embedding, and BERT's before its token types and LayerNorm. A sequence longer than the
    learned positions is refused with the length to pass."""

    def __init__(self, vocab_size: int, max_positions: int, hidden: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.tokens = nn.Embedding(vocab_size, hidden)
        self.positions = nn.Embedding(max_positions, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = ids.shape[1]
        if seq_len > self.max_positions:
            raise PipeswapError(
                f"sequence length {seq_len} exceeds this model's context of "
                f"{self.max_positions} positions; pass seq_len <= {self.max_positions}"
            )
        positions = torch.arange(seq_len, device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused qkv projection (as GPT-2, BERT, ViT).

    Uses ``F.scaled_dot_product_attention``: it runs on the meta device, its CPU kernel is
    deterministic, and it saves O(T) tensors instead of the T x T attention matrix.
    """

    def __init__(self, hidden: int, heads: int, *, causal: bool) -> None:
        super().__init__()
        if hidden % heads != 0:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        # [B, T, 3D] -> 3 x [B, H, T, D/H]
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, hidden: int, inner: int, *, gelu: str) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, inner)
        self.act = nn.GELU(approximate=gelu)
        self.proj = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class PreNormBlock(nn.Module):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))``: the GPT-2 and ViT block."""

    def __init__(
        self, hidden: int, heads: int, inner: int, *, causal: bool, gelu: str, eps: float
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = SelfAttention(hidden, heads, causal=causal)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, inner, gelu=gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PostNormBlock(nn.Module):
    """``ln(x + attn(x))`` then ``ln(x + mlp(x))``: the original BERT layer."""

    def __init__(self, hidden: int, heads: int, inner: int, *, gelu: str, eps: float) -> None:
        super().__init__()
        self.attn = SelfAttention(hidden, heads, causal=False)
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, inner, gelu=gelu)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


def init_transformer_(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2/BERT initialisation: N(0, std) weights, zero biases, unit LayerNorms."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear | nn.Embedding):
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            bias = getattr(sub, "bias", None)
            if isinstance(bias, torch.Tensor):
                nn.init.zeros_(bias)
        elif isinstance(sub, nn.LayerNorm):
            nn.init.ones_(sub.weight)
            nn.init.zeros_(sub.bias)


def tie_output_(output: nn.Linear, embedding: nn.Embedding, *, tie: bool, init: bool) -> None:
    """Tie a language model's output projection to its token embedding (one matrix), or,
    untied and initialised, start it as a copy: the untied model (a pipeline's, whose first
    and last stages hold one each) then computes what the tied one does."""
    if tie:
        output.weight = embedding.weight
    elif init:
        with torch.no_grad():
            output.weight.copy_(embedding.weight)
