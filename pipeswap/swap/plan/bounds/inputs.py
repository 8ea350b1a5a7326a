"""What the bounds read: one micro-batch's memory model, and the case it runs in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from pipeswap.hardware.topology import Topology
from pipeswap.swap.plan.bounds.relief import Relief
from pipeswap.swap.plan.workload import Workload

__all__ = ["BoundInputs", "MicroBatch"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of ``workload`` (nothing recomputed) within ``budget_bytes``;
    ``relief`` is what recomputing at most ``relief.seconds`` may free (None: none)."""

    workload: Workload
    budget_bytes: int
    relief: Relief | None = None

    @cached_property
    def needs(self) -> list[int]:
        """``need[i]`` (docs/concepts.md): bytes of layers before i off the GPU during i."""
        return self.workload.needs(self.budget_bytes)

    @cached_property
    def before(self) -> list[int]:
        """``cum(<k)`` for every layer k: saved bytes of the layers before k."""
        before: list[int] = []
        total = 0
        for saved in self.workload.saved_bytes:
            before.append(total)
            total += saved
        return before

    def excess(self, k: int, i: int) -> float:
        """``need[i] - cum(<k)``, less what recomputation may free among layers k..i."""
        excess = self.needs[i] - self.before[k]
        if self.relief is None or excess <= 0:
            return excess
        return excess - self.relief.between(k, i)


@dataclass(frozen=True)
class BoundInputs:
    """The case every term family reads: a micro-batch on ``gpus`` of ``topology``,
    ``sync_every`` micro-batches per iteration, ``tail_s`` after the last backward."""

    micro: MicroBatch
    topology: Topology
    gpus: tuple[str, ...]
    sync_every: int
    tail_s: float = 0.0

    @classmethod
    def of(
        cls,
        workload: Workload,
        topology: Topology,
        gpus: Sequence[str],
        budget_bytes: int,
        sync_every: int,
        tail_s: float = 0.0,
    ) -> BoundInputs:
        micro = MicroBatch(workload.recomputing(()), budget_bytes)
        return cls(micro, topology, tuple(gpus), sync_every, tail_s)

    @property
    def workload(self) -> Workload:
        return self.micro.workload

    @property
    def relief(self) -> Relief | None:
        return self.micro.relief

    def allowing(self, seconds: float) -> BoundInputs:
        """These inputs for plans recomputing at most ``seconds`` per micro-batch."""
        relief = Relief(self.workload, seconds) if seconds > 0 else None
        return replace(self, micro=replace(self.micro, relief=relief))

    def hops(self, gpu: str) -> list[tuple[int, int]]:
        """(link, direction) of every hop from ``gpu`` to its host memory."""
        return self.topology.path(gpu, self.topology.host_of(gpu))

    def path_bytes_per_s(self, gpu: str) -> float:
        """The slowest link of ``gpu``'s path to its host memory, per direction."""
        return min(self.topology.links[link].bytes_per_s for link, _ in self.hops(gpu))

    @cached_property
    def users(self) -> dict[int, list[str]]:
        """Per link: the GPUs whose path to host crosses it, in ``gpus`` order."""
        users: dict[int, list[str]] = {}
        for gpu in self.gpus:
            for link, _ in self.hops(gpu):
                users.setdefault(link, []).append(gpu)
        return users
