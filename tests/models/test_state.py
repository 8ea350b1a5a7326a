"""pipeswap/models/state.py: a module and the random generators are left as they were found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.state import ModuleSnapshot, untouched


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))


def test_a_training_pass_leaves_no_trace() -> None:
    net = _net()
    net[3].eval()
    state = {n: t.clone() for n, t in net.state_dict().items()}
    rng = torch.random.get_rng_state()
    with untouched(net):
        net.train()
        net(torch.randn(8, 4)).sum().backward()
    assert all(torch.equal(state[n], t) for n, t in net.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in net.parameters())  # the pass's gradients are dropped
    assert net[1].training and not net[3].training


def test_a_weight_written_in_place_is_named() -> None:
    net = _net()
    with pytest.raises(PipeswapError, match=r"0\.weight"), untouched(net):
        with torch.no_grad():
            net[0].weight.add_(1.0)


def test_restore_without_check_puts_buffers_back() -> None:
    net = _net()
    snapshot = ModuleSnapshot(net)
    net(torch.randn(8, 4))  # BatchNorm statistics move
    snapshot.restore(check=False)
    assert torch.equal(net[1].running_mean, torch.zeros(4))
