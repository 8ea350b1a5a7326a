"""Streams and events that are CUDA's on a GPU and no-ops on the CPU, so one code path serves both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Union

import torch

__all__ = [
    "CPU_STREAM",
    "AnyEvent",
    "AnyStream",
    "CPUEvent",
    "CPUStream",
    "current_stream",
    "is_cuda",
    "new_event",
    "new_stream",
    "record_event",
    "use_stream",
    "wait_event",
    "wait_stream",
]


class CPUStream:
    """The CPU's only "stream": work issued on it is already done when the call returns."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CPUStream()"


class CPUEvent:
    """An event on the CPU stream: always complete, so waiting on it costs nothing."""

    def record(self, stream: AnyStream | None = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


CPU_STREAM = CPUStream()

AnyStream = Union[torch.cuda.Stream, CPUStream]  # noqa: UP007  # a runtime alias, not a hint
AnyEvent = Union[torch.cuda.Event, CPUEvent]  # noqa: UP007


def is_cuda(stream: AnyStream) -> bool:
    return not isinstance(stream, CPUStream)


def new_stream(device: torch.device) -> AnyStream:
    """A fresh side stream on ``device`` (the CPU stream on the CPU)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AnyStream:
    """The stream compute is issued on now (the CPU stream on the CPU)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


def new_event(device: torch.device) -> AnyEvent:
    if device.type != "cuda":
        return CPUEvent()
    return torch.cuda.Event()


def record_event(stream: AnyStream) -> AnyEvent:
    """An event recorded on ``stream`` now: it completes when the work issued so far does."""
    if not is_cuda(stream):
        return CPUEvent()
    event = torch.cuda.Event()
    event.record(stream)  # type: ignore[arg-type]
    return event


def wait_stream(waiting: AnyStream, producer: AnyStream) -> None:
    """Make later work on ``waiting`` wait for the work issued so far on ``producer``."""
    if is_cuda(waiting) and is_cuda(producer):
        waiting.wait_stream(producer)  # type: ignore[union-attr, arg-type]


def wait_event(stream: AnyStream, event: AnyEvent) -> None:
    """Make later work on ``stream`` wait for ``event`` (no host blocking on CUDA)."""
    if is_cuda(stream) and isinstance(event, torch.cuda.Event):
        stream.wait_event(event)  # type: ignore[union-attr]


@contextmanager
def use_stream(stream: AnyStream) -> Iterator[None]:
    """Issue the work inside the block on ``stream``."""
    if not is_cuda(stream):
        yield
        return
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        yield
