"""pipeswap/swap/runtime/forward_buffers.py: a re-run starts from the buffers its forward found."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.swap.runtime.forward_buffers import ChangedBuffers


class _Counter(nn.Module):
    """Reads a buffer and moves it on, as spectral_norm's power iteration does; keeps a
    large table it never changes (a rotary table, a causal mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.ones(3))
        self.register_buffer("table", torch.arange(1000.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * self.state
        with torch.no_grad():
            self.state.mul_(2)
        return out


def test_a_rerun_starts_from_the_buffers_the_forward_found_and_leaves_them_as_they_are() -> None:
    module, changed = _Counter(), ChangedBuffers()
    x = torch.ones(3)
    found = changed.before_forward("a", module)
    first = module(x)
    found.kept()
    assert torch.equal(module.state, torch.full((3,), 2.0))
    again = found.rerun(module, module.forward, x)
    assert torch.equal(again, first)  # read 1, as the forward did, not 2
    assert torch.equal(module.state, torch.full((3,), 2.0))  # updated once, not twice


def test_only_the_buffers_a_layer_changed_are_copied_from_its_next_forward_on() -> None:
    module, changed = _Counter(), ChangedBuffers()
    found = changed.before_forward("a", module)
    assert len(found._copies) == 2  # a layer not met yet: every buffer copied once
    module(torch.ones(3))
    assert list(found.kept()._copies) == [0]  # the table's copy is let go after the forward
    assert list(changed.before_forward("a", module)._copies) == [0]
    module.eval()  # another mode: its own note
    assert len(changed.before_forward("a", module)._copies) == 2


class _Calls(nn.Module):
    """Counts its calls in a plain attribute and reads the count (an annealed scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x / self.calls


def test_a_rerun_starts_from_the_numbers_the_forward_found_and_leaves_them() -> None:
    module, changed = nn.Sequential(_Calls()), ChangedBuffers()
    x = torch.ones(2)
    found = changed.before_forward("a", module)
    first = module(x)
    found.kept()
    again = found.rerun(module, module.forward, x)
    assert torch.equal(again, first)  # divided by 1, as the forward was, not by 2
    assert module[0].calls == 1  # counted once, not twice
