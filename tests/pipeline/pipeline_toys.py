"""Small hand-built LayeredModels for pipeline tests (importable as ``pipeline_toys:NAME``)."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.models import build_model
from pipeswap.models.base import LayeredModel


class _PairOut(nn.Module):
    """Returns (activations, integer mask): a tuple crosses the cut after this layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.linear(x))
        return h, (h > 0).long()


class _PairIn(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = pair
        return torch.relu(self.linear(h)) + mask.float()


class _Dict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x}


def toy_mlp() -> LayeredModel:
    """A 5-layer classifier on 3x8x8 images (10 classes)."""
    blocks = [("flatten", nn.Flatten()), ("fc0", nn.Linear(192, 32))]
    blocks += [(f"fc{i}", nn.Sequential(nn.Tanh(), nn.Linear(32, 32))) for i in (1, 2)]
    blocks.append(("out", nn.Sequential(nn.Tanh(), nn.Linear(32, 10))))
    return LayeredModel("toy-mlp", blocks, "classify", num_classes=10)


def toy_tuple() -> LayeredModel:
    """A classifier whose second layer hands a (tensor, int mask) tuple to the third."""
    blocks = [
        ("flatten", nn.Sequential(nn.Flatten(), nn.Linear(192, 16))),
        ("pair_out", _PairOut(16)),
        ("pair_in", _PairIn(16)),
        ("out", nn.Linear(16, 10)),
    ]
    return LayeredModel("toy-tuple", blocks, "classify", num_classes=10)


def toy_dict() -> LayeredModel:
    """Broken on purpose: its second layer returns a dict."""
    blocks = [("flatten", nn.Flatten()), ("as_dict", _Dict()), ("out", nn.Linear(192, 10))]
    return LayeredModel("toy-dict", blocks, "classify", num_classes=10)


class _TiedEmbed(nn.Module):
    """Token ids [B, T] -> [B, T, D], then dropout."""

    def __init__(self, vocab: int, width: int, p: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        nn.init.normal_(self.tokens.weight, std=0.1)  # tied logits start near uniform
        self.drop = nn.Dropout(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tokens(ids))


class _Residual(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(x)))


class _TiedHead(nn.Module):
    """[B, T, D] -> logits [B, T, V] through the (tied) embedding matrix."""

    def __init__(self, embed: nn.Embedding, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, embed.num_embeddings, bias=False)
        self.out.weight = embed.weight  # the tie: one Parameter in the first and last block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def _tied_lm(name: str, p: float, *, tie: bool = True) -> LayeredModel:
    vocab, width = 64, 32
    embed = _TiedEmbed(vocab, width, p)
    head = _TiedHead(embed.tokens, width)
    if not tie:  # the same starting weights, two parameters
        head.out.weight = nn.Parameter(embed.tokens.weight.detach().clone())
    blocks: list[tuple[str, nn.Module]] = [("embed", embed)]
    blocks += [(f"block{i}", _Residual(width, p)) for i in range(3)]
    blocks.append(("head", head))
    return LayeredModel(name, blocks, "lm", vocab_size=vocab)


def toy_tied_lm() -> LayeredModel:
    """A 5-block LM with dropout 0.1 whose head reuses the token embedding (tied weights)."""
    return _tied_lm("toy-tied-lm", 0.1)


def toy_tied_lm_nodrop() -> LayeredModel:
    """toy_tied_lm without dropout: deterministic, to compare with plain training."""
    return _tied_lm("toy-tied-lm-nodrop", 0.0)


def toy_untied_lm() -> LayeredModel:
    """toy_tied_lm (dropout 0.1) with its head untied from the embedding."""
    return _tied_lm("toy-untied-lm", 0.1, tie=False)


def gpt2_micro_untied() -> LayeredModel:
    """gpt2-micro with its head untied from the embedding (they start equal)."""
    return build_model("gpt2-micro", tie_embeddings=False, seed=None)
