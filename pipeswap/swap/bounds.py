"""The lower bound of a swap plan's iteration time (design.md): compute or link bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeswap.hardware.topology import Topology
from pipeswap.swap.workload import Workload


@dataclass(frozen=True)
class LowerBound:
    """``bound_s`` = max(``compute_s``, every directed link's minimum bytes / bandwidth).

    ``binding`` names what sets the bound: ``"compute"``, a directed link ``"a->b"``, or
    ``"copy engine of GPU"`` for a GPU whose single copy engine serializes both directions.
    """

    bound_s: float
    compute_s: float
    min_swap_bytes: int  # per GPU and direction, over the whole iteration
    link_s: dict[str, float]
    binding: str


def lower_bound(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    *,
    sync_every: int = 1,
) -> LowerBound:
    """No plan can run one iteration faster than this.

    Each micro-batch, a GPU must move at least ``peak - budget`` bytes to host and the same
    back; with more than one GPU, the ring all-reduce moves at least 2(n-1)/n of the
    gradient bytes out of and into every GPU (no in-network reduction on PCIe). Both
    cross the GPU's links toward its host memory.
    """
    compute_s = workload.compute_s(sync_every)
    deficit = max(0, workload.no_swap_peak_bytes() - budget_bytes) * sync_every
    n = len(gpus)
    gradient = sum(workload.param_bytes)
    reduce_bytes = 2 * (n - 1) * gradient / n if n > 1 else 0.0
    directed: dict[tuple[int, int], float] = {}
    engine_s: dict[str, float] = {}
    for gpu in gpus:
        hops = topology.path(gpu, topology.host_of(gpu))
        for step, (link, direction) in enumerate(hops):
            first_hop = 1.0 if step == 0 else 0.0
            up = (link, direction)
            down = (link, 1 - direction)
            directed[up] = directed.get(up, 0.0) + deficit + first_hop * reduce_bytes
            directed[down] = directed.get(down, 0.0) + deficit + first_hop * reduce_bytes
        if topology.node(gpu).copy_engines == 1 and hops and deficit:
            slowest = min(topology.links[link].bytes_per_s for link, _ in hops)
            engine_s[f"copy engine of {gpu}"] = 2 * deficit / slowest
    link_s: dict[str, float] = {}
    for (link, direction), nbytes in directed.items():
        edge = topology.links[link]
        a, b = (edge.a, edge.b) if direction == 0 else (edge.b, edge.a)
        link_s[f"{a}->{b}"] = nbytes / edge.bytes_per_s
    link_s.update(engine_s)
    binding, bound = "compute", compute_s
    for name, seconds in link_s.items():
        if seconds > bound:
            binding, bound = name, seconds
    return LowerBound(
        bound_s=bound,
        compute_s=compute_s,
        min_swap_bytes=deficit,
        link_s=link_s,
        binding=binding,
    )
