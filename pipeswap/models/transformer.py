"""Transformer parts shared by the GPT, BERT and ViT families: attention, MLP, blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "PostNormBlock", "PreNormBlock", "SelfAttention", "init_transformer_"]


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
