"""CPU streams and events are no-ops; CUDA ones order work across streams."""

from __future__ import annotations

import pytest
import torch

from pipeswap.streams import (
    CPU_STREAM,
    CPUEvent,
    current_stream,
    is_cuda,
    new_event,
    new_stream,
    record_event,
    use_stream,
    wait_event,
    wait_stream,
)

CPU = torch.device("cpu")


def test_cpu_streams_are_the_single_no_op_stream() -> None:
    assert new_stream(CPU) is CPU_STREAM
    assert current_stream(CPU) is CPU_STREAM
    assert not is_cuda(CPU_STREAM)


def test_cpu_events_are_always_complete() -> None:
    event = record_event(CPU_STREAM)
    assert isinstance(event, CPUEvent)
    assert event.query() is True
    event.synchronize()
    assert new_event(CPU).query() is True


def test_cpu_stream_context_and_waits_run_work_in_place() -> None:
    x = torch.arange(4.0)
    with use_stream(new_stream(CPU)):
        y = x * 2
    wait_stream(CPU_STREAM, CPU_STREAM)
    wait_event(CPU_STREAM, CPUEvent())
    assert torch.equal(y, torch.tensor([0.0, 2.0, 4.0, 6.0]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_copy_is_ordered_by_events() -> None:
    device = torch.device("cuda")
    compute = current_stream(device)
    side = new_stream(device)
    assert is_cuda(side) and side != compute
    source = torch.randn(1 << 20, device=device)
    host = torch.empty(source.shape, pin_memory=True)
    wait_stream(side, compute)
    with use_stream(side):
        host.copy_(source, non_blocking=True)
    done = record_event(side)
    done.synchronize()
    assert done.query()
    assert torch.equal(host, source.cpu())
    back = torch.empty_like(source)
    with use_stream(side):
        back.copy_(host, non_blocking=True)
    wait_event(compute, record_event(side))
    assert torch.equal(back, source)
