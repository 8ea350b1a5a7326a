"""Which GPU runs each stage of each replica: in order, Mobius-style, or by a contention search.

A placement is one row per replica, one GPU per stage. On a server whose GPUs share
PCIe switches two at a time, stages that copy to host at the same moment should sit
under different switches, while neighbouring stages exchange activations and a stage's
replicas all-reduce gradients, both cheaper under one switch. :func:`cross_mapping`
weighs the two on the schedule's idealized timeline; :func:`mobius_mapping` is Mobius's
rule alone (consecutive stages under different switches).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import combinations

from pipeswap.hardware.topology import Topology
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import Schedule, unit_time_order
from pipeswap.swap.plan.channels import channel_groups, path_bytes_per_s
from pipeswap.swap.plan.stage_costs import StageCosts
from pipeswap.swap.plan.stage_swap import StagePlan, prefetch_points, stage_order, unit_memory

__all__ = [
    "Placement",
    "Windows",
    "cross_mapping",
    "mobius_mapping",
    "overlap_s",
    "replica_major",
    "stage_major",
    "transfer_windows",
]

Placement = tuple[tuple[str, ...], ...]
# Per stage, per direction ("d2h", "h2d"): when its copies run on the idealized timeline.
Windows = list[dict[str, list[tuple[float, float]]]]


def replica_major(gpus: Sequence[str], stages: int, replicas: int) -> Placement:
    """Replica r on GPUs r*K .. r*K + K - 1 in topology order (a pipeline's stages close)."""
    return tuple(tuple(gpus[r * stages + k] for k in range(stages)) for r in range(replicas))


def stage_major(gpus: Sequence[str], stages: int, replicas: int) -> Placement:
    """Stage k's replicas on GPUs k*D .. k*D + D - 1 (each all-reduce close)."""
    return tuple(tuple(gpus[k * replicas + r] for k in range(stages)) for r in range(replicas))


def mobius_mapping(
    topology: Topology, gpus: Sequence[str], stages: int, replicas: int
) -> Placement:
    """Mobius's cross mapping: GPUs taken one switch after another, so consecutive
    stages (which move their data at nearly the same time in Mobius) sit under
    different switches."""
    groups = channel_groups(topology, gpus)
    width = max(len(g) for g in groups)
    order = [g[i] for i in range(width) for g in groups if i < len(g)]
    return replica_major(order, stages, replicas)


def transfer_windows(
    schedule: Schedule, stages: Sequence[StageCosts], plans: Sequence[StagePlan], bytes_per_s: float
) -> Windows:
    """Each stage's swap copies on the schedule's idealized timeline, alone on its path."""
    n = schedule.num_stages
    timeline = unit_time_order(
        schedule,
        forward_cost=max(sum(c.forward_s for c in stages) / n, 1e-9),
        backward_cost=max(sum(c.backward_s for c in stages) / n, 1e-9),
    )
    ends: list[list[float]] = [[] for _ in range(n)]
    for timed in timeline:
        if timed.action.is_compute:
            ends[timed.stage].append(timed.end)
    windows: Windows = []
    for k in range(n):
        order = stage_order(schedule, k)
        seconds = unit_memory(stages[k], plans[k]).swap / bytes_per_s
        found: dict[str, list[tuple[float, float]]] = {"d2h": [], "h2d": []}
        if seconds > 0:
            for i, (kind, _) in enumerate(order):
                if kind is ActionKind.F:
                    found["d2h"].append((ends[k][i], ends[k][i] + seconds))
            for point in prefetch_points(order, plans[k].lead).values():
                found["h2d"].append((ends[k][point], ends[k][point] + seconds))
        windows.append(found)
    return windows


def overlap_s(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total time two sets of intervals overlap (pair by pair)."""
    ys = sorted(b)
    ends = sorted(y1 for _, y1 in ys)
    if ends != [y1 for _, y1 in ys]:  # not one length each: pair them all
        return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in ys)
    total, first = 0.0, 0
    for x0, x1 in sorted(a):
        # Intervals of b ending before x starts never meet a later x either.
        while first < len(ys) and ys[first][1] <= x0:
            first += 1
        for y0, y1 in ys[first:]:
            if y0 >= x1:
                break
            total += max(0.0, min(x1, y1) - max(x0, y0))
    return total


def cross_mapping(
    topology: Topology,
    gpus: Sequence[str],
    stages: Sequence[StageCosts],
    windows: Windows,
    *,
    replicas: int,
    units: int,
    steps: int,
) -> Placement:
    """The placement whose switches see the least contention, as estimated from ``windows``.

    The cost of a placement is, per switch (channel group), the time its members' copies
    overlap in the same direction (one's swap-outs beside another's prefetches use the
    link's two directions and cost nothing: bidirectional overlap), plus the time of every transfer that must cross a
    switch's uplink because its two ends sit under different switches: the ``units``
    activations between neighbouring stages of a replica and, per step, the all-reduce
    of a stage whose replicas are split. Groups of equal size are interchangeable, so the
    search enumerates set partitions (105 for eight GPUs in pairs).
    """
    k_count = len(stages)
    groups = channel_groups(topology, gpus)
    bandwidth = min(path_bytes_per_s(topology, g) for g in gpus)
    items = [(r, k) for r in range(replicas) for k in range(k_count)]
    pair_cost = {
        (a, b): sum(overlap_s(windows[a[1]][d], windows[b[1]][d]) for d in ("d2h", "h2d"))
        for a, b in combinations(items, 2)
    }
    send_s = [2 * units * c.out_bytes / bandwidth for c in stages]
    reduce_s = [2 * steps * c.param_bytes / bandwidth for c in stages]
    best: tuple[float, list[tuple[tuple[int, int], ...]]] | None = None
    for blocks in _partitions(items, [len(g) for g in groups]):
        where = {item: b for b, block in enumerate(blocks) for item in block}
        cost = sum(pair_cost[pair] for block in blocks for pair in combinations(block, 2))
        cost += sum(
            send_s[k]
            for r in range(replicas)
            for k in range(k_count - 1)
            if where[(r, k)] != where[(r, k + 1)]
        )
        cost += sum(
            reduce_s[k] for k in range(k_count) if len({where[(r, k)] for r in range(replicas)}) > 1
        )
        if best is None or cost < best[0] - 1e-12:
            best = (cost, blocks)
    assert best is not None
    gpu_of = {
        item: group[i] for block, group in zip(best[1], groups) for i, item in enumerate(block)
    }
    return tuple(tuple(gpu_of[(r, k)] for k in range(k_count)) for r in range(replicas))


def _partitions(
    items: Sequence[tuple[int, int]], sizes: Sequence[int]
) -> Iterator[list[tuple[tuple[int, int], ...]]]:
    """Every way to deal ``items`` into blocks of ``sizes``, in order; when every block
    has one size the blocks are unordered (the first item opens the first block)."""
    if not sizes:
        if not items:
            yield []
        return
    size, rest_sizes = sizes[0], sizes[1:]
    if size > len(items):
        return
    if all(s == size for s in sizes):
        choices: Iterator[tuple[tuple[int, int], ...]] = (
            (items[0], *chosen) for chosen in combinations(items[1:], size - 1)
        )
    else:
        choices = combinations(items, size)
    for block in choices:
        remaining = [i for i in items if i not in block]
        for rest in _partitions(remaining, rest_sizes):
            yield [block, *rest]
