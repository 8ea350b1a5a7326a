"""Streams and events that log what is asked of them, for the swap runtime's CUDA paths on a CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pipeswap.swap.runtime import transfer
from pipeswap.swap.runtime.pool import HostPool


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, fake: FakeCuda, stream: FakeStream) -> None:
        self.fake = fake
        self.stream = stream
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.fake.complete_after is not None and self.queries > self.fake.complete_after:
            self.done = True
        return self.done

    def synchronize(self) -> None:
        self.fake.log.append(("synchronize", self))
        self.done = True


class FakeCuda:
    """Streams and events that log what is asked of them; copies run at once on the CPU."""

    def __init__(self, complete_after: int | None = None) -> None:
        self.complete_after = complete_after  # queries an event answers False before True
        self.compute = FakeStream("compute")
        self.current = self.compute
        self.log: list[tuple[Any, ...]] = []
        self.sides: list[FakeStream] = []
        self.host_storages: set[int] = set()  # data pointers of host pool buffers

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "current_stream",
            "new_stream",
            "record_event",
            "use_stream",
            "wait_event",
            "wait_stream",
        ):
            monkeypatch.setattr(transfer, name, getattr(self, name))
        monkeypatch.setattr(transfer, "_copy", self.copy)
        real_init = HostPool.__init__

        def pool_init(pool: HostPool, *args: Any, **kwargs: Any) -> None:
            real_init(pool, *args, **kwargs)
            self.host_storages.add(pool.buffer.untyped_storage().data_ptr())

        monkeypatch.setattr(HostPool, "__init__", pool_init)

    def new_stream(self, device: torch.device) -> FakeStream:
        stream = FakeStream(f"side{len(self.sides)}")
        self.sides.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def record_event(self, stream: FakeStream) -> FakeEvent:
        event = FakeEvent(self, stream)
        self.log.append(("record", stream, event))
        return event

    def wait_stream(self, waiting: FakeStream, producer: FakeStream) -> None:
        self.log.append(("wait_stream", waiting, producer))

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self.log.append(("wait_event", stream, event))

    @contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def copy(self, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool) -> None:
        to_host = destination.untyped_storage().data_ptr() in self.host_storages
        self.log.append(("copy", self.current, "d2h" if to_host else "h2d", non_blocking))
        destination.copy_(source)
