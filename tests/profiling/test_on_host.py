"""pipeswap/profiling/on_host.py: a step with every saved tensor on the host, as it would run."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pipeswap.profiling.meter import StorageMeter
from pipeswap.profiling.on_host import as_plain, every_saved_tensor_on_host
from pipeswap.profiling.profile import StepMemory


def _memory(forward: list[int], backward: list[int], turn: int) -> StepMemory:
    return StepMemory(
        start_bytes=100,
        forward_peak_bytes=tuple(forward),
        backward_peak_bytes=tuple(backward),
        turn_peak_bytes=turn,
        step_peak_bytes=500,
    )


def test_as_plain_adds_the_saved_bytes_of_the_layers_before_the_one_running() -> None:
    records = {
        "a": [SimpleNamespace(bytes=10), SimpleNamespace(bytes=5)],
        "b": [SimpleNamespace(bytes=20)],
        "c": [SimpleNamespace(bytes=40)],
    }
    plain = as_plain(_memory([1, 2, 3], [4, 5, 6], 7), records, ["a", "b", "c"])
    assert plain.forward_peak_bytes == (1, 2 + 15, 3 + 35)
    assert plain.backward_peak_bytes == (4, 5 + 15, 6 + 35)
    assert plain.turn_peak_bytes == 7 + 35  # the last layer's (and the head's) are there
    assert (plain.start_bytes, plain.step_peak_bytes) == (100, 500)


def test_bring_back_before_a_timed_backward_leaves_the_backward_nothing_to_copy() -> None:
    torch.manual_seed(0)
    layers = {
        name: nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for name in "ab"
    }
    model = nn.Sequential(*layers.values())
    x = torch.randn(16, 32)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with StorageMeter("cpu", holding=(model, x)) as meter:
        with every_saved_tensor_on_host(model, layers) as on_host:
            loss = model(x).square().sum()
            on_host.entering(None)  # the forward is over: the last layer's go to the host
            before = meter.current
            on_host.bring_back("b")
            on_host.bring_back("a")
            assert meter.current > before  # both layers' storages are back on the device
            assert on_host.saved == {}  # nothing left for the backward to fetch
            loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
