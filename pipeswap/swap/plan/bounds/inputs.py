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
        """``need[i]``: bytes of layers before i off the GPU during forward or backward i
        (the larger of ``forward_needs[i]`` and ``backward_needs[i]``)."""
        return self.workload.needs(self.budget_bytes)

    @cached_property
    def _points(self) -> tuple[list[int], list[int]]:
        return self.workload.memory_points(())

    @cached_property
    def forward_needs(self) -> list[int]:
        """``need_F[i]`` (docs/concepts.md): bytes of layers before i that must be off the
        GPU while forward i runs (its saved tensors and forward working set allocated)."""
        return [max(0, point - self.budget_bytes) for point in self._points[0]]

    @cached_property
    def backward_needs(self) -> list[int]:
        """``need_B[j]`` (docs/concepts.md): bytes of layers before j that must be off the
        GPU while backward j runs (its backward working set allocated). On a measured
        profile it differs from ``need_F[j]``: the backward's working set holds the
        gradients made so far, the forward's the turn."""
        return [max(0, point - self.budget_bytes) for point in self._points[1]]

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
        """``need_F[i] - cum(<k)``, less what recomputation may free among layers k..i:
        bytes of layers k..i-1 whose swap-out ended before forward i starts."""
        return self._less_relief(self.forward_needs[i] - self.before[k], k, i)

    def backward_excess(self, k: int, j: int) -> float:
        """``need_B[j] - cum(<k)``, less what recomputation may free among layers k..j:
        bytes of layers k..j-1 off the GPU from before backward j starts until it ends."""
        return self._less_relief(self.backward_needs[j] - self.before[k], k, j)

    def _less_relief(self, excess: int, k: int, i: int) -> float:
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
