"""pipeswap/models/state.py: a module and the random generators are left as they were found."""

from __future__ import annotations

import random

import numpy
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


class _Counting(nn.Module):
    """A forward that keeps Python state: it counts its calls and takes a branch by them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls, self.scale, self._private = 0, 1.0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.scale *= 2.0
        self._private += 1
        return self.linear(x) if self.calls % 2 else -self.linear(x)


def test_a_forward_s_own_counters_are_put_back() -> None:
    """Trial passes (naming, timing, metering) must not move a user's call counter: the
    next training forward would take another branch than without pipeswap."""
    net = _Counting()
    with untouched(net):
        net(torch.randn(2, 4))
        net(torch.randn(2, 4))
        net(torch.randn(2, 4))
    assert (net.calls, net.scale) == (0, 1.0)
    assert net._private == 3  # torch's and the module's private attributes are left alone


class _Collecting(nn.Module):
    """Blocks that append an auxiliary loss to a list the loop sums (and clears), and
    note activations in a dict, both shared with the root module."""

    def __init__(self) -> None:
        super().__init__()
        self.aux: list[torch.Tensor] = []
        self.seen: dict[str, torch.Tensor] = {}
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        for block in self.blocks:
            block.sink, block.notes = self.aux, self.seen  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            block.sink.append(x.pow(2).mean())
            block.notes[f"block{i}"] = x
        return x


def test_what_a_forward_adds_to_the_model_s_lists_and_dicts_is_taken_back() -> None:
    """A trial forward's auxiliary losses would be summed into the loop's loss (offload's
    planning forwards run inside the user's step): the contents are put back in place,
    and the objects stay the ones the loop holds."""
    net = _Collecting()
    aux, seen = net.aux, net.seen
    net(torch.randn(2, 4))
    before = (list(aux), dict(seen))
    with untouched(net):
        net(torch.randn(2, 4))
    assert net.aux is aux and net.seen is seen
    assert len(aux) == 2 and all(a is b for a, b in zip(aux, before[0], strict=True))
    assert seen.keys() == before[1].keys() and all(seen[k] is before[1][k] for k in seen)


def test_untouched_leaves_numpy_s_and_python_s_generators_as_they_were() -> None:
    """A model's own code may draw from them (wav2vec2's SpecAugment masks from NumPy's):
    a pass run aside had moved them on, and the loop's next masks differed."""
    model = torch.nn.Linear(2, 2)
    numpy.random.seed(3)
    random.seed(3)
    expected = (numpy.random.random(), random.random())
    numpy.random.seed(3)
    random.seed(3)
    with untouched(model):
        numpy.random.random(5)
        random.random()
    assert (numpy.random.random(), random.random()) == expected
