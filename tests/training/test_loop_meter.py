"""pipeswap/training/loop_meter.py: what offload reads of the device around a user's step."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.training.loop_meter import LoopMeter
from pipeswap.training.shape_plan import ShapePlan

CPU = torch.device("cpu")


def test_on_the_cpu_the_optimizer_step_after_a_timed_step_is_read() -> None:
    """The storage count reads the step through the optimizer's hooks: at least the
    parameters, their gradients and the momentum buffers the first step makes."""
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    meter = LoopMeter(CPU, (model, optimizer), lambda *_: None)
    meter.time(BlockTiming(), optimizer_hooked=True)
    model(torch.randn(8, 64)).sum().backward()
    meter.optimizer_step(True)
    optimizer.step()
    meter.optimizer_step(False)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert meter.step_peak_bytes >= 3 * params
    # At the next forward: what the model and optimizer hold (the count, stopped at the
    # optimizer step, counts the momentum buffers it made there too).
    assert meter.stop() == 3 * params
    meter.optimizer_step(True)  # a later step is not read again
    assert meter.step_meter is None


def test_a_plan_s_first_step_is_measured_until_the_next_forward() -> None:
    seen: list[tuple[ShapePlan, int]] = []
    meter = LoopMeter(CPU, (), lambda planned, peak: seen.append((planned, peak)))
    placeholder: Any = None
    planned = ShapePlan(None, placeholder, placeholder, 1 << 20, 0.0)
    meter.watch(planned)
    assert meter.meter is not None
    meter.meter.__enter__()
    held = torch.ones(1024)  # 4 KiB made and kept inside the step
    assert meter.peak_so_far(planned) == held.numel() * held.element_size()
    meter.meter.__exit__(None, None, None)
    assert meter.stop() is not None and seen == [(planned, 4096)]
    planned.measured_peak_bytes = 4096
    assert meter.peak_so_far(planned) == 4096


def test_on_cuda_every_planned_step_is_read_for_stats(monkeypatch: Any) -> None:
    """The allocator (faked here) is read over each step from its forward: the most so far,
    reset at the next step's forward."""
    allocator = {"now": 100, "peak": 100}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: allocator["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: allocator["peak"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda *_: allocator.update(peak=allocator["now"])
    )
    meter = LoopMeter(torch.device("cuda"), (), lambda *_: None)
    assert meter.step_peak_so_far() is None  # no step read yet
    meter.watch_step()
    allocator.update(now=150, peak=400)
    assert meter.step_peak_so_far() == 400
    assert meter.stop() == 150 and meter.step_peak_so_far() is None
    meter.watch_step()  # the next step starts from what is held now
    assert meter.step_peak_so_far() == 150


def test_on_the_cpu_a_watched_step_is_counted_from_its_forward_to_its_optimizer_step() -> None:
    """The storage count: what the step's call holds from the start, what its forward and
    backward make, the optimizer state it cannot see; it stops at the optimizer's step."""
    model = nn.Linear(256, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = LoopMeter(CPU, (model, optimizer), lambda *_: None)
    batch = torch.randn(64, 256)
    meter.watch_step((batch,), unseen_bytes=1000)
    model(batch).sum().backward()
    params = sum(p.nbytes for p in model.parameters())
    # The parameters and their gradients, the batch, and the state it cannot see.
    assert meter.step_peak_so_far() >= 2 * params + batch.nbytes + 1000
    before = meter.step_peak_so_far()
    meter.optimizer_step(True)
    torch.randn(4096, 4096)  # 64 MiB made after the count stopped
    assert meter.step_peak_so_far() == before
    assert meter.stop() is None and meter.step_peak_so_far() is None


def test_on_the_cpu_a_timed_step_s_count_is_taken_off_by_any_optimizer_step_or_collection() -> None:
    """The count is a dispatch mode left on into the loop's code: taken off at the next
    step of any optimizer (one offload was not given too), or when the meter is collected
    (a loop that ends with a learnt step): a mode left on would slow every later op."""
    model = nn.Linear(64, 64)
    meter = LoopMeter(CPU, (model,), lambda *_: None)
    meter.time(BlockTiming(), optimizer_hooked=False)
    model(torch.randn(8, 64)).sum().backward()
    assert len(_get_current_dispatch_mode_stack()) == 1
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # an optimizer offload was not given
    assert _get_current_dispatch_mode_stack() == []
    meter.time(BlockTiming(), optimizer_hooked=False)
    assert len(_get_current_dispatch_mode_stack()) == 1
    del meter
    gc.collect()
    assert _get_current_dispatch_mode_stack() == []
