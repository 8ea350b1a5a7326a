"""Small hand-built LayeredModels for pipeline tests (importable as ``pipeline_toys:NAME``)."""

from __future__ import annotations

import torch
from torch import nn

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
