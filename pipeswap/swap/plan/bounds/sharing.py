"""The turn bound's terms for links several GPUs share: within an iteration, and at its edges.

docs/concepts.md, "Why the swap bounds are valid" ("Shared channels" and "Sharing at the
edges of a sync", with and without recomputation), says why each holds.
"""

from __future__ import annotations

from pipeswap.swap.plan.bounds.inputs import BoundInputs, MicroBatch
from pipeswap.swap.plan.bounds.recursion import backward_starts, forward_ends, micro_batch_s
from pipeswap.swap.plan.bounds.relief import Relief

__all__ = ["channel_terms", "sharing_terms"]


def channel_terms(inputs: BoundInputs) -> dict[str, float]:
    """Per directed link: the shared-channel term."""
    micro, relief, sync_every = inputs.micro, inputs.relief, inputs.sync_every
    workload = micro.workload
    full = micro.forward_needs
    if not any(micro.needs):
        return {}

    def relieved(needs: list[int]) -> list[int]:
        if relief is None:
            return needs
        return [max(0, int(need - relief.between(0, i))) for i, need in enumerate(needs)]

    forward_needs, backward_needs = relieved(full), relieved(micro.backward_needs)
    n = workload.num_layers
    forward, backward = workload.forward_s, workload.backward_s
    total_forward, total_backward = sum(forward), sum(backward)
    tail = inputs.tail_s
    # The best layer to cut at, per unit of bytes per second: max over i of
    # head_i + K * users * need[i] / C + rest_i, evaluated per link below. Swap-outs:
    # need_F[i] leaves between the first forward's end and forward i of the last
    # micro-batch, need_B[j] before its backward j starts. Prefetches: need_B[j] comes
    # back after backward j of the first micro-batch ends, need_F[i] after its forward i
    # ends, both before the last micro-batch's backward 0 starts.
    up_edges = [(forward[0], sum(forward[i:]) + total_backward + tail) for i in range(n)]
    up_late = [(forward[0], sum(backward[: j + 1]) + tail) for j in range(n)]
    down_edges = [(total_forward + sum(backward[j:]), backward[0] + tail) for j in range(n)]
    down_early = [(sum(forward[: i + 1]), backward[0] + tail) for i in range(n)]
    ins = [*zip(backward_needs, down_edges), *zip(forward_needs, down_early)]
    outs = list(zip(backward_needs, up_late))
    if relief is None:
        outs += zip(forward_needs, up_edges)
    terms: dict[str, float] = {}
    for link, members in inputs.users.items():
        count = len(members)
        edge = inputs.topology.links[link]
        rate = edge.bytes_per_s / (sync_every * count)
        terms[f"{edge.a}<->{edge.b} prefetches"] = _cut(ins, rate)
        if relief is None:
            terms[f"{edge.a}<->{edge.b} swap-outs"] = _cut(outs, rate)
            continue
        # The GPU of the link that recomputes least (s <= T seconds) frees at most
        # through[i] - rate[i] (T - s) bytes up to layer i, and the late GPU still re-runs
        # at least s seconds in its last backward: min over s of the term (linear in s:
        # its minimum is at 0 or T).
        per_gpu = edge.bytes_per_s / sync_every
        best = _cut(outs, rate)
        for i, (head, rest) in enumerate(up_edges):
            excess = full[i] - relief.between(0, i)
            slope = relief.slope(0, i)
            if excess < 1:
                continue  # some GPU may move no byte: no term
            base = head + rest + count * excess / per_gpu
            least = min(
                base + slope * relief.seconds / per_gpu,  # s = 0
                base + relief.seconds,
            )  # s = T
            best = max(best, least)
        terms[f"{edge.a}<->{edge.b} swap-outs"] = best
    return terms


def _cut(pairs: list[tuple[int, tuple[float, float]]], rate: float) -> float:
    """max over the pairs (need, (head, rest)) that move bytes of head + need/rate + rest."""
    return max((head + need / rate + rest for need, (head, rest) in pairs if need), default=0.0)


def sharing_terms(inputs: BoundInputs, micro_s: dict[str, float]) -> dict[str, float]:
    """Per shared link: the first- and last-micro-batch terms ("Sharing at the edges of a
    sync"); ``micro_s`` is every GPU's shortest micro-batch."""
    micro = inputs.micro
    workload, relief, sync_every, tail = (
        inputs.workload,
        inputs.relief,
        inputs.sync_every,
        inputs.tail_s,
    )
    if not any(micro.needs):
        return {}
    forward_needs, backward_needs = micro.forward_needs, micro.backward_needs
    n = workload.num_layers
    backward_through = []  # Bk_{<=k}: what is left of a backward once layer k's may start
    total = 0.0
    for seconds in workload.backward_s:
        total += seconds
        backward_through.append(total)
    cache: dict[tuple[float, int, float, float], tuple[float, float]] = {}
    terms: dict[str, float] = {}
    for link, members in inputs.users.items():
        if len(members) < 2:
            continue
        capacity = inputs.topology.links[link].bytes_per_s
        # The fastest member's path and shortest micro-batch: valid for every member.
        own = max(inputs.path_bytes_per_s(g) for g in members)
        shortest = min(micro_s[g] for g in members)
        key = (capacity, len(members), own, shortest)
        if key not in cache:
            share = len(members) / capacity
            forward_end = forward_ends(micro, own)
            # From a turn the floors below may delay: the recursion alone. From the
            # recursion's own turn: with the swap-outs backward j waits for.
            backward_start = backward_starts(micro, own)
            backward_s = backward_start[0] + workload.backward_s[0]
            backward_after = backward_starts(micro, own, forward_end)
            rest = (sync_every - 1) * shortest + tail
            first = 0.0
            last = 0.0
            if relief is not None:
                first = _first_with_recompute(
                    inputs, relief, own, capacity, len(members), forward_end, backward_s, shortest
                )
            for i in range(n):
                if not forward_needs[i]:
                    continue
                # The later member reaches forward i of its first micro-batch only once every
                # member's need_F[i] bytes (those of layers k..i-1 made after E_k) crossed.
                floors = [
                    forward_end[k] + share * micro.excess(k, i)
                    for k in range(i)
                    if micro.excess(k, i) > 0
                ]
                if floors and relief is None:
                    delayed = forward_ends(micro, own, floor=(i, max(floors)))
                    first = max(first, delayed[-1] + backward_s + rest)
            for j in range(n):
                if not backward_needs[j]:
                    continue
                if relief is None:
                    # The later member starts backward j of its first micro-batch only once
                    # every member's need_B[j] bytes (those of layers k..j-1) crossed; it
                    # then runs backward j..0, K - 1 more micro-batches and the tail.
                    for k in range(j):
                        excess = micro.backward_excess(k, j)
                        if excess > 0:
                            at = forward_end[k] + share * excess
                            first = max(first, at + backward_through[j] + rest)
                # The earliest member starts backward j of its last micro-batch no sooner
                # than (K-1) shortest micro-batches and this one's prefix; then every
                # member's bytes of layers k..j-1 come back before their backward k.
                prefix = (
                    (sync_every - 1) * shortest
                    + forward_end[-1]
                    + backward_after[j]
                    + workload.backward_s[j]
                )
                for k in range(j):
                    excess = micro.backward_excess(k, j)
                    if excess > 0:
                        last = max(last, prefix + share * excess + backward_through[k] + tail)
            cache[key] = (first, last)
        first, last = cache[key]
        edge = inputs.topology.links[link]
        terms[f"{edge.a}<->{edge.b} first swap-outs"] = first
        terms[f"{edge.a}<->{edge.b} last prefetches"] = last
    return terms


def _first_with_recompute(
    inputs: BoundInputs,
    relief: Relief,
    own: float,
    capacity: float,
    members: int,
    forward_end: list[float],
    backward_s: float,
    shortest: float,
) -> float:
    """The first-micro-batch sharing term when members recompute at most ``relief.seconds``
    each ("With recomputation"): min over s, the least any member recomputes, of ``f(s)``.
    That member frees at most ``between - slope (T - s)`` among layers k..i, the others
    ``between``; the late member re-runs at least s seconds in every backward; and the
    member recomputing s takes at least ``P(s)``, K of its shortest micro-batches with s
    seconds of relief (on the fastest member's path), which does not grow with s. ``f``
    is convex in s (maxima and sums of affine pieces, through the forward recursion's
    max-plus steps) and its byte part ``D`` does not grow with s nor its time part ``H``
    shrink: with f evaluated at 0, T/4, ..., T, on each quarter every plan takes at least
    ``P(right end)``, ``D(right end) + H(left end)`` and the secants of the neighbouring
    quarters, extended (below a convex function outside their span); the term is the
    least over the quarters."""
    micro, workload = inputs.micro, inputs.workload
    needs, before = micro.forward_needs, micro.before
    sync_every, tail = inputs.sync_every, inputs.tail_s
    n = workload.num_layers
    total_forward, total_backward = sum(workload.forward_s), sum(workload.backward_s)
    seconds = relief.seconds

    def bytes_part(s: float) -> float:
        # The late member's turn: at least the recursion's, delayed by the floors.
        latest = forward_end[-1]
        for i in range(n):
            if not needs[i]:
                continue
            floor = None
            for k in range(i):
                raw = needs[i] - before[k]
                if raw <= 0:
                    continue
                excess = raw - relief.between(k, i)
                crossing = (members - 1) * max(0.0, excess) + max(
                    0.0, excess + relief.slope(k, i) * (seconds - s)
                )
                if crossing > 0:
                    at = forward_end[k] + crossing / capacity
                    floor = at if floor is None else max(floor, at)
            if floor is None:
                continue
            delayed = forward_ends(micro, own, floor=(i, floor))
            latest = max(latest, delayed[-1])
        return latest

    def time_part(s: float) -> float:
        return (
            max(backward_s, total_backward + s)
            + (sync_every - 1) * max(shortest, total_forward + total_backward + s)
            + tail
        )

    def alone(s: float) -> float:
        ease = MicroBatch(workload, micro.budget_bytes, Relief(workload, s) if s > 0 else None)
        return sync_every * micro_batch_s(ease, own) + tail

    pieces = 4
    points = [seconds * j / pieces for j in range(pieces)] + [seconds]
    d = [bytes_part(s) for s in points]
    f = [d[j] + time_part(points[j]) for j in range(pieces + 1)]

    def line(a: int, b: int, s: float) -> float:  # the secant of f through points a, b
        return f[a] + (f[b] - f[a]) * (s - points[a]) / (points[b] - points[a])

    least = float("inf")
    for j in range(pieces):
        lo, hi = points[j], points[j + 1]
        bound = max(alone(hi), d[j + 1] + time_part(lo))
        if j >= 1:
            bound = max(bound, min(line(j - 1, j, lo), line(j - 1, j, hi)))
        if j + 2 <= pieces:
            bound = max(bound, min(line(j + 1, j + 2, lo), line(j + 1, j + 2, hi)))
        least = min(least, bound)
    return least
