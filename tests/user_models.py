"""A user's own nn.Module (not a zoo model), shared by the swap executor and training tests."""

from __future__ import annotations

import torch
from torch import nn

# The blocks a user names for the swap executor: dotted module paths inside UserNet.
USER_LAYERS = ["encoder.0", "encoder.2", "mixer", "head"]


class UserNet(nn.Module):
    """A model that is not in the zoo: nested layers, a skip connection, ops between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU())
        self.mixer = nn.Linear(32, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.head(torch.relu(self.mixer(h)) + h)


# A user's model with dropout inside its blocks: recomputing a block must draw its masks again.
DROPOUT_LAYERS = ["block0", "block1", "head"]


class DropoutNet(nn.Module):
    """UserNet's shape with nn.Dropout(0.1) in the middle of two multi-op blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.block0 = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh()
        )
        self.block1 = nn.Sequential(
            nn.Linear(32, 32), nn.Dropout(0.1), nn.GELU(), nn.Linear(32, 32)
        )
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block0(x)
        return self.head(self.block1(h) + h)
