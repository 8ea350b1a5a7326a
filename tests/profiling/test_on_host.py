"""pipeswap/profiling/on_host.py: a step with every saved tensor on the host, as it would run."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.profiling.meter import DeviceMeter, MemoryMarks, StorageMeter
from pipeswap.profiling.on_host import every_saved_tensor_on_host


def test_marks_read_the_step_as_it_is_at_every_moment_of_an_interval() -> None:
    with DeviceMeter(torch.device("cpu")) as meter:
        marks = MemoryMarks(meter)
        a = torch.empty(1000, dtype=torch.uint8)
        marks.shift(500)  # 500 bytes away from now: 1000 + 500
        del a  # 0 + 500
        marks.close("one")
        b = torch.empty(300, dtype=torch.uint8)  # 300 + 500
        marks.shift(-500)  # (before a copy back of the 500)
        c = torch.empty(500, dtype=torch.uint8)  # 800
        marks.close("two")
        del b, c
    assert marks.peaks == {"one": 1500, "two": 800}


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
