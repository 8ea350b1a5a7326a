"""pipeswap/models/replay_check.py: a split is checked against the model's own output.

Blocks may return several tensors (attention weights, a cache: Bloom, MPT, RoFormer do);
only the hidden state travels on, which is right as long as the forward reads nothing
else of what they return. A forward that does is refused, naming why.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.replay import split_at_blocks


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.tanh(self.linear(h))
        return out, out.mean(-1)  # a second tensor, as attention weights are


class _Model(nn.Module):
    def __init__(self, reads_extra: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 4)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(4, 256)
        self.reads_extra = reads_extra

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        extra = torch.zeros(())
        for block in self.blocks:
            h, weights = block(h)
            if self.reads_extra:
                extra = extra + weights.sum()
        return self.head(h) + extra


def test_blocks_returning_several_tensors_pass_their_hidden_state() -> None:
    torch.manual_seed(0)
    model = _Model(reads_extra=False)
    ids = torch.randint(0, 256, (2, 6))
    layered = split_at_blocks(model, example=ids[:1], task="lm", name="m", vocab_size=256)
    assert torch.equal(layered(ids), model(ids))


def test_a_forward_reading_more_than_the_hidden_state_is_refused() -> None:
    model = _Model(reads_extra=True)
    ids = torch.randint(0, 256, (1, 6))
    with pytest.raises(PipeswapError, match="reads more of a block's output"):
        split_at_blocks(model, example=ids, task="lm", name="m", vocab_size=256)


def test_weights_that_are_not_finite_are_named_not_blamed_on_the_blocks() -> None:
    """Hostile input round 4: NaN never equals NaN, so the check names the parameter."""
    model = _Model(reads_extra=False)
    with torch.no_grad():
        model.blocks[1].linear.weight[0, 0] = float("nan")
    ids = torch.randint(0, 256, (1, 6))
    with pytest.raises(PipeswapError, match=r"parameter 'blocks\.1\.linear\.weight' holds NaN"):
        split_at_blocks(model, example=ids, task="lm", name="m", vocab_size=256)
