"""pipeswap/swap/runtime/held_state.py: state a layer's forward keeps on its modules.

A layer that leaves a tensor carrying its graph on a module attribute keeps its re-run's
saved tensors until the next forward, so recomputing it frees nothing: the capture names
it, and offload never recomputes it (policy recompute then keeps it, or refuses naming it)
and holds its budget on the meter, bit for bit the plain loop.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import pipeswap
from pipeswap.profiling.meter import DeviceMeter
from pipeswap.swap.runtime.held_state import graph_tensors, set_during
from pipeswap.swap.runtime.recompute_sizes import measure_recomputation


class Block(nn.Module):
    """A block whose forward (``keeps``) stores a graph-carrying tensor on ``self`` before
    the operations that save more (as RecurrentGemma's recurrent block does), so a re-run
    in the backward sets it too."""

    def __init__(self, d: int, keeps: bool) -> None:
        super().__init__()
        self.a, self.b, self.keeps = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), keeps
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.a(x))
        s = s * torch.tanh(s)
        if self.keeps:
            self.state = s
        return x + self.b(torch.relu(s))


class Net(nn.Module):
    def __init__(self, d: int = 32, stateful: tuple[int, ...] = (1, 2)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, i in stateful) for i in range(4))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def test_the_attributes_a_forward_left_holding_the_graph_are_named() -> None:
    layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    kept_before = layer[0](x)
    layer[1].old = kept_before  # held before the forward: not the forward's state
    layer[0].buffer_like = torch.zeros(3)  # no graph
    before = graph_tensors(layer)
    y = layer(x)
    layer[0].pair = (y.detach(), y * 2)  # one level inside a tuple
    layer[1].named = {"h": y}  # and inside a dict
    layer.plain = y.detach()
    assert set_during(layer, before) == ("0.pair[1]", "1.named['h']")
    assert "0.weight" not in graph_tensors(layer)  # parameters are no state
    layer[1].old = layer[0](x)  # set again: a new graph in the same attribute
    assert set_during(layer, before) == ("0.pair[1]", "1.named['h']", "1.old")


def test_the_capture_names_the_layers_that_keep_state() -> None:
    model = Net()
    layers = {f"blocks.{i}": model.blocks[i] for i in range(4)}
    sizes = measure_recomputation(
        model, layers, list(layers), lambda: model(torch.randn(2, 8, 32)), selective=False
    )
    assert sizes.held == {"blocks.1": ("state",), "blocks.2": ("state",)}
    assert sizes.profile_fields("blocks.1", 1.0)["held_state"] == "state"
    assert sizes.profile_fields("blocks.0", 1.0)["held_state"] is None


def _loop(
    steps: int = 4, **settings: Any
) -> tuple[list[int], list[float], list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = pipeswap.offload(model, optimizer=opt, **settings) if settings else None
    peaks, losses = [], []
    for i in range(steps):
        x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(i))
        meter = DeviceMeter("cpu", holding=(model, opt, x), exclude=off.host_pools() if off else [])
        with meter:
            if off is None:
                loss = model(x)
            else:
                with off:
                    loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peaks.append(meter.peak)
        losses.append(loss.item())
    weights = [p.detach().clone() for p in model.parameters()]
    return peaks, losses, weights, None if off is None else off.stats()


def test_recompute_keeps_the_layers_that_keep_state_and_holds_its_budget() -> None:
    _, plain_losses, plain_weights, _ = _loop()
    # Every block recomputed, the re-runs of blocks 1 and 2 would stay held through their
    # state until the next forward: far over this budget, unseen by the plan.
    with pytest.raises(
        pipeswap.ConfigError, match=r"'blocks.1' \(state\), 'blocks.2' \(state\)"
    ) as e:
        _loop(policy="recompute", footprint_ratio=1.5)
    least = int(str(e.value).split("smallest budget that works is ")[1].split()[0])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        peaks, losses, weights, stats = _loop(policy="recompute", gpu_memory=least)
    assert stats["recomputed_layers"] == 2  # blocks 0 and 3
    assert max(peaks[1:]) <= stats["budget_bytes"], (peaks, stats)
    assert any("'blocks.1' (state)" in str(w.message) for w in said)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))


@pytest.mark.parametrize("policy", ["hybrid", "finer"])
def test_a_policy_that_chooses_never_recomputes_a_layer_that_keeps_state(policy: str) -> None:
    _, plain_losses, plain_weights, _ = _loop()
    try:
        peaks, losses, weights, stats = _loop(policy=policy, footprint_ratio=1.25)
    except pipeswap.ConfigError as exc:
        assert "'blocks.1' (state)" in str(exc)
        return
    assert max(peaks[1:]) <= stats["budget_bytes"], (peaks, stats)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
