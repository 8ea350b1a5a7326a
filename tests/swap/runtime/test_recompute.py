"""pipeswap/swap/runtime/recompute.py: recomputed layers' forwards wrapped, and given back."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.transfer import DeviceLedger


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2


def test_a_recomputed_layer_reruns_in_the_backward_with_the_same_result() -> None:
    layers = {"a": _Scale(), "b": _Scale()}
    ledger = DeviceLedger()
    recomputation = Recomputation(layers, ["b"], ledger, account=True)
    x = torch.randn(4, requires_grad=True)
    expected = torch.autograd.grad(layers["b"](layers["a"](x)).sum(), x)[0]
    recomputation.install()
    assert "forward" in vars(layers["b"]) and "forward" not in vars(layers["a"])
    recomputation.rerun_bytes = {"b": 16}
    recomputation.start_step()
    recomputation.active = True
    got = torch.autograd.grad(layers["b"](layers["a"](x)).sum(), x)[0]
    recomputation.active = False
    assert torch.equal(got, expected)
    assert recomputation.finish_step() == (1, 16)  # b ran again once, saving 16 bytes
    assert ledger.live_bytes == 0  # its bytes were let go of with the step
    recomputation.remove()
    assert "forward" not in vars(layers["b"])


def test_recomputations_removed_in_any_order_leave_the_others_installed() -> None:
    """Plans of several shapes wrap one model at once; the first made is often the first
    closed (a shape planned again): the later one keeps recomputing, and once every one is
    removed the layer has its own forward back."""
    layers = {"b": _Scale()}
    first, second = (Recomputation(layers, ["b"], DeviceLedger(), account=True) for _ in "12")
    first.install()
    second.install()
    first.remove()
    x = torch.randn(4, requires_grad=True)
    second.rerun_bytes = {"b": 16}
    second.start_step()
    second.active = True
    torch.autograd.grad(layers["b"](x).sum(), x)
    second.active = False
    assert second.finish_step() == (1, 16)  # still wrapped: b ran again in the backward
    second.remove()
    assert "forward" not in vars(layers["b"])
    first.install()
    second.install()
    second.remove()
    first.remove()
    assert "forward" not in vars(layers["b"])
