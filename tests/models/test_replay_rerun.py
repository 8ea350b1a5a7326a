"""pipeswap/models/replay_rerun.py: a second run of the code before the blocks leaves no trace."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.models.replay_rerun import rerun_quietly

CPU = torch.device("cpu")


def test_buffers_are_put_back_and_the_generator_rewound_at_the_first_block() -> None:
    norm = nn.BatchNorm1d(3).train()
    counter = nn.Module()
    counter.register_buffer("calls", torch.zeros((), dtype=torch.long))
    x = torch.randn(4, 3)
    norm(x)  # the first run: the statistics count this batch once
    once = {name: b.clone() for name, b in norm.named_buffers()}
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    with rerun_quietly([norm, counter], CPU) as at_first_block:
        again = norm(x)  # the second run, in the module's own (train) mode
        counter.calls += 1
        torch.rand(7)  # a draw before the blocks: dropped
        at_first_block()
        after = torch.rand(2)  # the code after the blocks draws as the model's forward
    assert torch.equal(after, expected)
    assert torch.allclose(again.mean(0), torch.zeros(3), atol=1e-6)  # by the batch
    assert all(torch.equal(b, once[name]) for name, b in norm.named_buffers())
    assert int(counter.calls) == 0
