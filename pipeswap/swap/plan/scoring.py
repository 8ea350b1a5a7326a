"""Score an assignment of swaps and recomputation by simulating the exact task graph it produces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeswap.hardware.topology import Topology
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import TaskGraph
from pipeswap.sim.result import SimResult
from pipeswap.swap.plan.iteration import build_iteration_graph
from pipeswap.swap.plan.tensors import SwapDecisionAt
from pipeswap.swap.plan.workload import Workload

__all__ = ["Assignment", "Scored", "score"]


@dataclass(frozen=True)
class Assignment:
    """What a policy decides: per GPU its swaps, its start offset (seconds) and the layers
    it recomputes (none by default); ``selective``: the recomputed layers that are
    recomputed selectively (the same on every GPU)."""

    swaps: Mapping[str, tuple[SwapDecisionAt, ...]]
    offsets_s: Mapping[str, float] = field(default_factory=dict)
    recompute: Mapping[str, frozenset[int]] = field(default_factory=dict)
    selective: frozenset[int] = frozenset()

    def swapped_bytes(self, gpu: str) -> int:
        return sum(s.bytes for s in self.swaps.get(gpu, ()))

    def recomputed(self, gpu: str) -> frozenset[int]:
        return frozenset(self.recompute.get(gpu, ()))


@dataclass(frozen=True)
class Scored:
    assignment: Assignment
    graph: TaskGraph
    result: SimResult

    @property
    def iteration_s(self) -> float:
        return self.result.makespan_s


def score(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    assignment: Assignment,
    *,
    sync_every: int,
    bucket_bytes: int,
) -> Scored:
    """Simulate ``assignment``; ``topology`` already carries every GPU's memory budget."""
    graph = build_iteration_graph(
        workload.selecting(assignment.selective),
        gpus,
        assignment.swaps,
        offsets_s=assignment.offsets_s,
        recompute=assignment.recompute,
        sync_every=sync_every,
        bucket_bytes=bucket_bytes,
    )
    return Scored(assignment, graph, simulate(graph, topology))
