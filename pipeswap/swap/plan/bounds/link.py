"""design.md's link bound: compute, or the bytes the busiest directed link must carry.

docs/concepts.md, "Why the swap bounds are valid" ("Link bound"), says why it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeswap.hardware.topology import Topology
from pipeswap.swap.plan.bounds.inputs import BoundInputs
from pipeswap.swap.plan.bounds.relief import Relief, min_max, recompute_limit_s
from pipeswap.swap.plan.workload import Workload

__all__ = ["LowerBound", "lower_bound"]


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
    recompute_s: float = 0.0  # T at the bound: recompute seconds per micro-batch, at most


def lower_bound(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    *,
    sync_every: int = 1,
    recompute: bool = True,
) -> LowerBound:
    """No plan can run one iteration faster than this (design.md's formula).

    Each micro-batch, a GPU must move at least ``peak - budget`` bytes to host and the same
    back; with more than one GPU, the ring all-reduce moves at least 2(n-1)/n of the
    gradient bytes out of and into every GPU (no in-network reduction on PCIe). Both
    cross the GPU's links toward its host memory. A plan that recomputes T seconds per
    micro-batch may move ``relief_T`` fewer bytes but computes ``K T`` longer: the bound
    is the minimum over T (docs/concepts.md, "With recomputation"); ``recompute=False``
    gives the bound of plans that only swap.
    """
    inputs = BoundInputs.of(workload, topology, gpus, budget_bytes, sync_every)
    base = inputs.workload
    compute_s = base.compute_s(sync_every)
    needs = inputs.micro.needs
    limit = recompute_limit_s(base) if recompute else 0.0

    def at(seconds: float) -> LowerBound:
        relief = Relief(base, seconds)
        per_micro = max((need - relief.through[i] for i, need in enumerate(needs)), default=0)
        return _link_bound(inputs, max(0, int(per_micro)) * sync_every, compute_s, seconds)

    def increasing(seconds: float) -> float:
        return compute_s + sync_every * seconds

    def decreasing(seconds: float) -> float:
        return max(at(seconds).link_s.values(), default=0.0)

    bound, seconds = min_max(decreasing, increasing, limit)
    found = at(seconds)
    if bound <= found.bound_s:
        return found
    binding = "compute + recompute" if increasing(seconds) >= decreasing(seconds) else found.binding
    return LowerBound(bound, compute_s, found.min_swap_bytes, found.link_s, binding, seconds)


def _link_bound(
    inputs: BoundInputs, deficit: int, compute_s: float, recompute_s: float
) -> LowerBound:
    """design.md's bound for ``deficit`` bytes per GPU and direction (the iteration's)."""
    topology, gpus = inputs.topology, inputs.gpus
    n = len(gpus)
    gradient = sum(inputs.workload.param_bytes)
    reduce_bytes = 2 * (n - 1) * gradient / n if n > 1 else 0.0
    directed: dict[tuple[int, int], float] = {}
    engine_s: dict[str, float] = {}
    for gpu in gpus:
        hops = inputs.hops(gpu)
        for step, (link, direction) in enumerate(hops):
            first_hop = 1.0 if step == 0 else 0.0
            up = (link, direction)
            down = (link, 1 - direction)
            directed[up] = directed.get(up, 0.0) + deficit + first_hop * reduce_bytes
            directed[down] = directed.get(down, 0.0) + deficit + first_hop * reduce_bytes
        if topology.node(gpu).copy_engines == 1 and hops and deficit:
            engine_s[f"copy engine of {gpu}"] = 2 * deficit / inputs.path_bytes_per_s(gpu)
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
        recompute_s=recompute_s,
    )
