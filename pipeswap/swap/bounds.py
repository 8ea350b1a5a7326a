"""Lower bounds of a swap plan's iteration time: design.md's link bound and the turn bound.

Two bounds, both valid for every plan the iteration graph can express (any tensors, any
swap-out and prefetch points, any start offsets, any ``--sync-every``), and the planner
reports the larger as the best bound known.

**Link bound** (design.md, ``lower_bound``): the iteration takes at least the compute of
the busiest GPU, and at least, for every directed link, the bytes that must cross it
divided by its bandwidth, where every GPU moves at least ``peak - budget`` bytes each way
per micro-batch (and the ring all-reduce 2(n-1)/n of the gradients over its first hop).

**Turn bound** (``turn_bound``). The link bound lets a GPU move its bytes at any moment
of the iteration; it cannot. Take one micro-batch on GPU g, whose own path to host memory
carries at most ``B`` bytes/s per direction (the slowest link of the path; sharing, a
single copy engine or duplex loss only lower it). Let ``need[i]`` be the bytes of layers
before ``i`` that must be off the GPU while layer ``i`` runs (``Workload.needs``; its
largest value is ``D = peak - budget``) and ``cum(<k)`` the saved bytes of layers before
``k``. Forward ``i`` starts at ``T_i`` and ends at ``E_i = T_i + F_i``; backward ``j``
starts at ``S_j``.

* Forward: at ``T_i`` at least ``need[i]`` bytes have *finished* their swap-out (memory
  is freed when a copy ends). At most ``cum(<k)`` of them belong to layers before ``k``;
  the rest belong to layers ``k..i-1``, which exist only from ``E_k`` on, and went out
  one after another at rate at most ``B``. Hence, for every ``k < i``,
  ``T_i >= E_k + (need[i] - cum(<k)) / B``, and ``T_i >= E_{i-1}``.
* Backward, the mirror image: backward ``j`` holds its memory (its saved tensors and
  working set) from ``S_j`` until it ends, so until ``S_j + Bk_j`` at least ``need[j]``
  bytes of layers before ``j`` have not *started* their prefetch (memory is taken when
  it starts); those of layers ``k..j-1`` must be back before ``S_k``. Hence
  ``S_k >= S_j + Bk_j + (need[j] - cum(<k)) / B`` for every ``k < j``, and
  ``S_k >= S_{k+1} + Bk_{k+1}``; ``S_{L-1}`` is the turn ``E_{L-1}``.

This longest-path recursion gives the shortest possible micro-batch ``M_g`` of GPU g;
with ``k = 0`` and ``i`` the peak layer it contains the simple form
``M_g >= max(F, D/B) + max(Bk, D/B)`` (F, Bk: forward and backward compute of a
micro-batch): the bytes leave during the forward and come back during the backward.
Micro-batches run one after another on the compute stream, so an iteration takes at least
``offset + K * M_g`` to its last backward, then the last gradient bucket's ring
all-reduce (it needs every GPU's last backward; each of its 2(n-1) steps sends
``bucket / n`` bytes over every GPU's first hop; counted when layer 0 closes that
bucket) and the optimizer step:
``turn bound = max_g K * M_g + tail + step``. Offsets are at least 0, the all-reduce of
earlier buckets and contention with other GPUs only add time, so the bound holds for
every plan.

**Shared channels, valid under any offsets.** A link ``l`` of capacity ``C`` that the
swaps of GPUs ``G_l`` cross carries, per micro-batch and GPU, the ``need[i]`` bytes that
must have left before forward ``i``. Every one of them leaves after the first forward of
the iteration ends (time >= ``F_0``, offsets only delay) and before forward ``i`` of the
last micro-batch starts, which is at least ``F_{>=i} + Bk + tail`` before the end. So the
iteration takes at least ``F_0 + K |G_l| need[i] / C + F_{>=i} + Bk + tail``. Mirrored for
prefetches: the ``need[j]`` bytes off the GPU at backward ``j`` come back after backward
``j`` of the first micro-batch starts (>= ``F + Bk_{>j}``) and before the last backward
starts: ``F + Bk_{>j} + K |G_l| need[j] / C + Bk_0 + tail``. The turn bound is the
largest of these, the per-GPU term and the two terms below. With ``K = 1`` the edges
(compute during which the shared link cannot help) are what the link bound misses.

**Sharing at the edges of a sync, valid under any offsets.** Let the members of ``G_l``
share link ``l`` (capacity ``C``), ``B`` be the fastest member's own path and ``M`` the
shortest member's micro-batch (the recursions above give lower bounds on every member's
event times with that ``B``: ``E_k``, ``S_j`` below are those bounds).

* First micro-batch, swap-outs: at forward ``i`` of its first micro-batch every member
  has finished the swap-outs of ``need[i]`` bytes, of which at least ``need[i] - cum(<k)``
  belong to layers ``k..i-1`` and so left after ``E_k``. Take the member ``L`` that
  reaches forward ``i`` last: by then the link carried ``|G_l| (need[i] - cum(<k))`` bytes
  after ``E_k``, so ``T_L(i) >= E_k + |G_l| (need[i] - cum(<k)) / C`` for every ``k < i``.
  From there ``L`` still runs the forward recursion from ``i`` on, its backward, ``K - 1``
  more micro-batches (each at least ``M``) and the tail.
* Last micro-batch, prefetches: let ``E`` be the member that ends backward ``j`` of its
  last micro-batch first, no sooner than ``(K - 1) M`` plus the recursion's end of
  backward ``j``. Every member then still has at least ``need[j] - cum(<k)`` bytes of
  layers ``k..j-1`` to bring back through the link before its backward ``k``; the member
  whose last byte arrives last then runs backward ``k..0`` and the tail:
  ``(K - 1) M + S_j + Bk_j + |G_l| (need[j] - cum(<k)) / C + Bk_{<=k} + tail``.

Both hold whatever the offsets: an offset only delays the late member further. They
state what bidirectional overlapping pays at every sync: members cannot all start
swapping at once, so one of them is late by about one member's swap-outs.

**With recomputation** (plans that recompute layers, ``Workload``'s memory model).
Recomputing layer k frees ``freed[k]`` = its saved bytes minus the input it keeps from
its forward on (``Workload.freed_bytes``; negative values never help) and costs
``F_k`` (its forward) once more per micro-batch on the compute stream. For a set R, the
forward need at i drops to ``need[i] - freed_R(<= i)``, the backward need at j to no
less than ``need[j] - freed_R(< j)`` (the re-run's tensors are at least the saved bytes
the layer would have held), and ``cum(<k)`` to ``cum(<k) - freed_R(<k)``: every
difference ``need[i] - cum(<k)`` the terms above use drops by at most
``freed_R(k..i)``. Let ``t_g`` be GPU g's recompute seconds per micro-batch and
``T = max_g t_g``. Whatever R, ``freed_R(k..i) <= relief_T(k, i)`` :=
min(the fractional knapsack of the layers <= i with capacity T seconds, the freed
bytes of the layers k..i), since R's layers <= i cost at most ``t_g <= T`` (the
fractional knapsack allows any fraction of a layer, so it is at least any set's
bytes). Every term above with its bytes lowered by ``relief_T`` (and compute times
unchanged: recomputation only lengthens backwards) is a valid bound ``d(T)`` for every
plan whose GPUs recompute at most T seconds; it does not increase with T. The compute
stream adds ``i(T) = K (F + Bk + T) + tail`` for the GPU recomputing T (and
``compute + K T`` for the link bound). So every plan takes at least
``min over T of max(d(T), i(T))``: with ``d`` non-increasing and ``i`` increasing, a
bisection brackets the crossing in ``[lo, hi]`` (``d(lo) > i(lo)``, ``d(hi) <= i(hi)``) and
``max(min(d(lo), d(hi)), i(lo))`` is below the minimum (a plan recomputing at most lo
takes at least ``d(lo) > i(lo)``; between, at least ``d(hi)`` and ``i(lo)``; above hi at
least ``i(T) >= i(hi) >= d(hi)``; this needs no monotony of the computed ``d``). With
nothing worth recomputing, T = 0 and the bounds are the swap-only ones.

**Re-runs on shared links.** Two terms also count the re-runs, which lengthen the
backwards. Let ``s`` be the least any member of a link recomputes (``s <= T``). The
fractional knapsack is concave in its seconds, so that member frees at most
``relief_T - slope_T (T - s)`` bytes (``slope_T``: the bytes per second of the layer the
knapsack takes in part at T, ``Relief.slope``), the others at most ``relief_T``.

* Shared channel, swap-outs: after forward i of its last micro-batch the late GPU still
  runs ``F_{>=i} + Bk`` and re-runs at least s seconds: the term is
  ``F_0 + K ((|G_l| - 1) x + x + slope (T - s)) / C + F_{>=i} + Bk + s + tail`` with
  ``x = need[i] - relief_T(0, i)``, linear in s: its least over ``[0, T]`` is at 0 or T
  (kept only where ``x > 0``, so that every GPU moves a byte).
* First micro-batch, swap-outs: the late member's bytes after ``E_k`` are counted per
  member as above, its backward is at least ``max(recursion, Bk + s)`` and its K - 1 other
  micro-batches at least ``max(M, F + Bk + s)``; the member recomputing s also takes at
  least K of its own shortest micro-batches with s seconds of relief. The term, convex in
  s, is bounded below on each quarter of ``[0, T]`` (``_first_with_recompute``) and the
  least over the quarters is kept.

Both hold for every split of the recompute seconds among the GPUs (the tests enumerate
every pair of recompute sets of two GPUs on one link).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeswap.hardware.topology import Topology
from pipeswap.swap.workload import Workload, gradient_buckets


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


@dataclass(frozen=True)
class TurnBound:
    """The turn bound (module docstring): ``bound_s = max_g K * microbatch_s[g] + tail``.

    ``microbatch_s`` is each GPU's shortest possible micro-batch; ``tail_s`` the last
    bucket's all-reduce plus the optimizer step; ``binding`` the GPU that sets the bound.
    """

    bound_s: float
    microbatch_s: dict[str, float]
    tail_s: float
    channel_s: dict[str, float]
    binding: str
    recompute_s: float = 0.0  # T at the bound (module docstring, "With recomputation")


class Relief:
    """``relief_T(k, i)``: at most the forward bytes recomputation can free among layers
    k..i when a GPU recomputes at most ``seconds`` per micro-batch (module docstring)."""

    def __init__(self, workload: Workload, seconds: float) -> None:
        n = workload.num_layers
        freed = [max(0, b) for b in workload.freed_bytes]
        self.prefix = [0] * (n + 1)  # freed bytes of layers < i
        for i, b in enumerate(freed):
            self.prefix[i + 1] = self.prefix[i] + b
        # Fractional knapsack of layers <= i: best bytes per second first.
        self.seconds = seconds
        self.through = [0.0] * n
        # Marginal bytes per second of the knapsack of layers <= i at ``seconds`` (the rate
        # of the layer it takes in part; 0 when every layer fits): relief with s <= seconds
        # is at most through[i] - rate[i] * (seconds - s), the knapsack being concave.
        self.rate = [0.0] * n
        if seconds > 0:
            items: list[tuple[float, int]] = []  # (-bytes per second, layer)
            for i in range(n):
                if freed[i] > 0:
                    rate = (
                        freed[i] / workload.forward_s[i]
                        if workload.forward_s[i] > 0
                        else float("inf")
                    )
                    bisect.insort(items, (-rate, i))
                left, total = seconds, 0.0
                for _, k in items:
                    cost = workload.forward_s[k]
                    if cost <= left:
                        total += freed[k]
                        left -= cost
                    else:
                        total += freed[k] * left / cost
                        self.rate[i] = freed[k] / cost
                        break
                self.through[i] = total

    def between(self, k: int, i: int) -> float:
        """Freed bytes of layers k..i that recomputation can account for."""
        return min(self.through[i], self.prefix[i + 1] - self.prefix[k])

    def slope(self, k: int, i: int) -> float:
        """A supergradient of ``between(k, i)`` in the seconds: with s <= ``seconds``
        recompute seconds, at most ``between(k, i) - slope(k, i) * (seconds - s)``."""
        return self.rate[i] if self.through[i] < self.prefix[i + 1] - self.prefix[k] else 0.0


def recompute_limit_s(workload: Workload) -> float:
    """Recompute seconds beyond which no more forward memory can be freed (a hair above
    the sum, so that at it every layer fits the knapsack whole, whatever the rounding)."""
    total = sum(f for f, b in zip(workload.forward_s, workload.freed_bytes) if b > 0)
    return total * (1 + 1e-9) + 1e-12 if total > 0 else 0.0


def _min_max(
    decreasing: Callable[[float], float],
    increasing: Callable[[float], float],
    limit: float,
    steps: int = 40,
) -> tuple[float, float]:
    """A lower bound of min over T >= 0 of max(decreasing(T), increasing(T)), and the T at
    which it was found (module docstring, "With recomputation")."""
    if limit <= 0 or decreasing(0.0) <= increasing(0.0):
        return max(decreasing(0.0), increasing(0.0)), 0.0
    at_limit = decreasing(limit)
    if at_limit > increasing(limit):
        return at_limit, limit  # beyond ``limit`` nothing more is freed
    lo, hi = 0.0, limit
    for _ in range(steps):
        mid = (lo + hi) / 2
        if decreasing(mid) > increasing(mid):
            lo = mid
        else:
            hi = mid
    # d(T) holds for every plan recomputing at most T, whether or not it is monotone: a
    # plan at most lo takes d(lo) > i(lo), one between i(lo) and d(hi), one above
    # i(hi) >= d(hi) and i(lo).
    return max(min(decreasing(lo), decreasing(hi)), increasing(lo)), hi


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
    is the minimum over T (module docstring, "With recomputation"); ``recompute=False``
    gives the bound of plans that only swap.
    """
    base = workload.recomputing(())
    compute_s = base.compute_s(sync_every)
    needs = base.needs(budget_bytes)
    limit = recompute_limit_s(base) if recompute else 0.0

    def at(seconds: float) -> LowerBound:
        relief = Relief(base, seconds)
        per_micro = max((need - relief.through[i] for i, need in enumerate(needs)), default=0)
        return _link_bound(
            base, topology, gpus, max(0, int(per_micro)) * sync_every, compute_s, seconds
        )

    def increasing(seconds: float) -> float:
        return compute_s + sync_every * seconds

    def decreasing(seconds: float) -> float:
        return max(at(seconds).link_s.values(), default=0.0)

    bound, seconds = _min_max(decreasing, increasing, limit)
    found = at(seconds)
    if bound <= found.bound_s:
        return found
    binding = "compute + recompute" if increasing(seconds) >= decreasing(seconds) else found.binding
    return LowerBound(bound, compute_s, found.min_swap_bytes, found.link_s, binding, seconds)


def _link_bound(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    deficit: int,
    compute_s: float,
    recompute_s: float,
) -> LowerBound:
    """design.md's bound for ``deficit`` bytes per GPU and direction (the iteration's)."""
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
        recompute_s=recompute_s,
    )


def _cumulative_before(workload: Workload) -> list[int]:
    """``cum(<k)`` for every layer k: saved bytes of the layers before k."""
    before: list[int] = []
    total = 0
    for saved in workload.saved_bytes:
        before.append(total)
        total += saved
    return before


def _excess(
    needs: Sequence[int], before: Sequence[int], relief: Relief | None, k: int, i: int
) -> float:
    """``need[i] - cum(<k)``, less what recomputation may free among layers k..i."""
    excess = needs[i] - before[k]
    return excess if relief is None or excess <= 0 else excess - relief.between(k, i)


def _forward_ends(
    workload: Workload,
    needs: Sequence[int],
    before: Sequence[int],
    bytes_per_s: float,
    floor: tuple[int, float] | None = None,
    relief: Relief | None = None,
) -> list[float]:
    """Earliest end of every forward of a micro-batch starting at 0 (the forward recursion
    of the module docstring); ``floor = (i, t)`` adds ``T_i >= t``."""
    forward_end: list[float] = []
    start = 0.0
    for i in range(workload.num_layers):
        for k in range(i):
            excess = _excess(needs, before, relief, k, i)
            if excess > 0:
                start = max(start, forward_end[k] + excess / bytes_per_s)
        if floor is not None and floor[0] == i:
            start = max(start, floor[1])
        forward_end.append(start + workload.forward_s[i])
        start = forward_end[-1]
    return forward_end


def _backward_starts(
    workload: Workload,
    needs: Sequence[int],
    before: Sequence[int],
    bytes_per_s: float,
    relief: Relief | None = None,
) -> list[float]:
    """Earliest start of every backward, counted from the turn (the backward recursion)."""
    n = workload.num_layers
    backward_start = [0.0] * n
    for k in reversed(range(n - 1)):
        at = backward_start[k + 1] + workload.backward_s[k + 1]
        for j in range(k + 1, n):
            excess = _excess(needs, before, relief, k, j)
            if excess > 0:
                # need[j] stays off the GPU until backward j ends (it holds its memory).
                ends = backward_start[j] + workload.backward_s[j]
                at = max(at, ends + excess / bytes_per_s)
        backward_start[k] = at
    return backward_start


def shortest_microbatch_s(
    workload: Workload, budget_bytes: int, bytes_per_s: float, relief: Relief | None = None
) -> float:
    """The shortest micro-batch any plan without recomputation (or, with ``relief``, any
    plan recomputing at most its seconds, less those seconds) can achieve on a path of
    ``bytes_per_s`` per direction: the forward and backward recursions of the module
    docstring."""
    needs = workload.needs(budget_bytes)
    before = _cumulative_before(workload)
    forward_end = _forward_ends(workload, needs, before, bytes_per_s, relief=relief)
    backward_start = _backward_starts(workload, needs, before, bytes_per_s, relief)
    return forward_end[-1] + backward_start[0] + workload.backward_s[0]


def turn_bound(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    *,
    sync_every: int = 1,
    bucket_bytes: int | None = None,
    recompute: bool = True,
) -> TurnBound:
    """No plan can run one iteration faster than this (the turn bound, module docstring).

    ``bucket_bytes`` (the all-reduce bucket size) adds the last bucket's all-reduce to the
    tail; None leaves it out (still a bound, a looser one). Plans that recompute are
    covered by the minimum over their recompute seconds T ("With recomputation");
    ``recompute=False`` gives the bound of plans that only swap.
    """
    workload = workload.recomputing(())
    tail = workload.optimizer_step_s
    n = len(gpus)
    if n > 1 and bucket_bytes is not None:
        buckets = gradient_buckets(workload, bucket_bytes)
        # Only a bucket closed by layer 0's backward must start after the last backward.
        if buckets and buckets[-1].layer == 0:
            last_bytes = buckets[-1].bytes
            first_hop = min(
                topology.links[topology.path(g, topology.host_of(g))[0][0]].bytes_per_s
                for g in gpus
            )
            tail += 2 * (n - 1) * (last_bytes / n) / first_hop
    limit = recompute_limit_s(workload) if recompute else 0.0
    if limit <= 0 or not any(workload.needs(budget_bytes)):
        return _turn_bound(workload, topology, gpus, budget_bytes, sync_every, tail, None)
    chain = sync_every * (sum(workload.forward_s) + sum(workload.backward_s)) + tail
    cache: dict[float, TurnBound] = {}

    def at(seconds: float) -> TurnBound:
        if seconds not in cache:
            relief = Relief(workload, seconds) if seconds > 0 else None
            cache[seconds] = _turn_bound(
                workload, topology, gpus, budget_bytes, sync_every, tail, relief, seconds
            )
        return cache[seconds]

    def increasing(seconds: float) -> float:
        return chain + sync_every * seconds

    bound, seconds = _min_max(lambda t: at(t).bound_s, increasing, limit)
    found = at(seconds)
    binding = "compute + recompute" if increasing(seconds) >= found.bound_s else found.binding
    return TurnBound(bound, found.microbatch_s, tail, found.channel_s, binding, seconds)


def _turn_bound(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    sync_every: int,
    tail: float,
    relief: Relief | None,
    recompute_s: float = 0.0,
) -> TurnBound:
    """Every term of the turn bound, with bytes lowered by ``relief`` (None: no plan
    recomputes)."""
    micro: dict[str, float] = {}
    for gpu in gpus:
        hops = topology.path(gpu, topology.host_of(gpu))
        bandwidth = min(topology.links[link].bytes_per_s for link, _ in hops)
        micro[gpu] = shortest_microbatch_s(workload, budget_bytes, bandwidth, relief)
    slowest = max(micro, key=lambda g: micro[g])
    terms = {slowest: sync_every * micro[slowest] + tail}
    channel = _channel_terms(workload, topology, gpus, budget_bytes, sync_every, tail, relief)
    channel.update(
        _sharing_terms(workload, topology, gpus, budget_bytes, sync_every, tail, micro, relief)
    )
    terms.update(channel)
    binding = max(terms, key=lambda name: terms[name])
    return TurnBound(
        bound_s=terms[binding],
        microbatch_s=micro,
        tail_s=tail,
        channel_s=channel,
        binding=binding,
        recompute_s=recompute_s,
    )


def _channel_terms(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    sync_every: int,
    tail: float,
    relief: Relief | None = None,
) -> dict[str, float]:
    """Per directed link: the shared-channel term of the module docstring."""
    full = workload.needs(budget_bytes)
    needs = full
    if relief is not None:
        needs = [max(0, int(need - relief.between(0, i))) for i, need in enumerate(full)]
    if not any(needs):
        return {}
    n = workload.num_layers
    forward, backward = workload.forward_s, workload.backward_s
    total_forward, total_backward = sum(forward), sum(backward)
    # The best layer to cut at, per unit of bytes per second: max over i of
    # head_i + K * users * need[i] / C + rest_i, evaluated per link below.
    up_edges = [(forward[0], sum(forward[i:]) + total_backward + tail) for i in range(n)]
    down_edges = [(total_forward + sum(backward[j + 1 :]), backward[0] + tail) for j in range(n)]
    users: dict[int, int] = {}
    for gpu in gpus:
        for link, _ in topology.path(gpu, topology.host_of(gpu)):
            users[link] = users.get(link, 0) + 1
    terms: dict[str, float] = {}
    for link, count in users.items():
        edge = topology.links[link]
        rate = edge.bytes_per_s / (sync_every * count)
        terms[f"{edge.a}<->{edge.b} prefetches"] = max(
            head + need / rate + rest for need, (head, rest) in zip(needs, down_edges) if need
        )
        if relief is None:
            terms[f"{edge.a}<->{edge.b} swap-outs"] = max(
                head + need / rate + rest for need, (head, rest) in zip(needs, up_edges) if need
            )
            continue
        # The GPU of the link that recomputes least (s <= T seconds) frees at most
        # through[i] - rate[i] (T - s) bytes up to layer i, and the late GPU still re-runs
        # at least s seconds in its last backward: min over s of the term (linear in s:
        # its minimum is at 0 or T).
        per_gpu = edge.bytes_per_s / sync_every
        best = 0.0
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


def _sharing_terms(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    sync_every: int,
    tail: float,
    micro: dict[str, float],
    relief: Relief | None = None,
) -> dict[str, float]:
    """Per shared link: the first- and last-micro-batch terms (module docstring, "Sharing
    at the edges of a sync")."""
    needs = workload.needs(budget_bytes)
    if not any(needs):
        return {}
    users: dict[int, list[str]] = {}
    for gpu in gpus:
        for link, _ in topology.path(gpu, topology.host_of(gpu)):
            users.setdefault(link, []).append(gpu)
    before = _cumulative_before(workload)
    n = workload.num_layers
    backward_through = []  # Bk_{<=k}: what is left of a backward once layer k's may start
    total = 0.0
    for seconds in workload.backward_s:
        total += seconds
        backward_through.append(total)
    cache: dict[tuple[float, int, float, float], tuple[float, float]] = {}
    terms: dict[str, float] = {}
    for link, members in users.items():
        if len(members) < 2:
            continue
        capacity = topology.links[link].bytes_per_s
        # The fastest member's path and shortest micro-batch: valid for every member.
        own = max(
            min(topology.links[hop].bytes_per_s for hop, _ in topology.path(g, topology.host_of(g)))
            for g in members
        )
        shortest = min(micro[g] for g in members)
        key = (capacity, len(members), own, shortest)
        if key not in cache:
            share = len(members) / capacity
            forward_end = _forward_ends(workload, needs, before, own, relief=relief)
            backward_start = _backward_starts(workload, needs, before, own, relief)
            backward_s = backward_start[0] + workload.backward_s[0]
            rest = (sync_every - 1) * shortest + tail
            first = 0.0
            last = 0.0
            if relief is not None:
                first = _first_with_recompute(
                    workload,
                    needs,
                    before,
                    own,
                    relief,
                    capacity,
                    len(members),
                    forward_end,
                    backward_s,
                    shortest,
                    sync_every,
                    tail,
                    budget_bytes,
                )
            for i in range(n):
                if not needs[i]:
                    continue
                # The later member reaches forward i of its first micro-batch only once every
                # member's need[i] bytes (those of layers k..i-1 made after E_k) crossed.
                floors = [
                    forward_end[k] + share * _excess(needs, before, relief, k, i)
                    for k in range(i)
                    if _excess(needs, before, relief, k, i) > 0
                ]
                if not floors:
                    continue
                if relief is None:
                    delayed = _forward_ends(workload, needs, before, own, floor=(i, max(floors)))
                    first = max(first, delayed[-1] + backward_s + rest)
                # The earliest member starts backward i of its last micro-batch no sooner
                # than (K-1) shortest micro-batches and this one's prefix; then every
                # member's bytes of layers k..i-1 come back before their backward k.
                prefix = (
                    (sync_every - 1) * shortest
                    + forward_end[-1]
                    + backward_start[i]
                    + workload.backward_s[i]
                )
                for k in range(i):
                    excess = _excess(needs, before, relief, k, i)
                    if excess > 0:
                        last = max(last, prefix + share * excess + backward_through[k] + tail)
            cache[key] = (first, last)
        first, last = cache[key]
        edge = topology.links[link]
        terms[f"{edge.a}<->{edge.b} first swap-outs"] = first
        terms[f"{edge.a}<->{edge.b} last prefetches"] = last
    return terms


def _first_with_recompute(
    workload: Workload,
    needs: Sequence[int],
    before: Sequence[int],
    own: float,
    relief: Relief,
    capacity: float,
    members: int,
    forward_end: Sequence[float],
    backward_s: float,
    shortest: float,
    sync_every: int,
    tail: float,
    budget_bytes: int,
) -> float:
    """The first-micro-batch sharing term when members recompute at most ``relief.seconds``
    each (module docstring, "With recomputation"): min over s, the least any member
    recomputes, of ``f(s)``. That member frees at most ``between - slope (T - s)`` among
    layers k..i, the others ``between``; the late member re-runs at least s seconds in
    every backward; and the member recomputing s takes at least ``P(s)``, K of its
    shortest micro-batches with s seconds of relief (on the fastest member's path), which
    does not grow with s. ``f`` is convex in s (maxima and sums of affine pieces, through
    the forward recursion's max-plus steps) and its byte part ``D`` does not grow with s nor
    its time part ``H`` shrink: with f evaluated at 0, T/4, ..., T, on each quarter every
    plan takes at least ``P(right end)``, ``D(right end) + H(left end)`` and the secants of
    the neighbouring quarters, extended (below a convex function outside their span); the
    term is the least over the quarters."""
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
            delayed = _forward_ends(workload, needs, before, own, floor=(i, floor), relief=relief)
            latest = max(latest, delayed[-1])
        return latest

    def time_part(s: float) -> float:
        return (
            max(backward_s, total_backward + s)
            + (sync_every - 1) * max(shortest, total_forward + total_backward + s)
            + tail
        )

    def alone(s: float) -> float:
        ease = Relief(workload, s) if s > 0 else None
        return sync_every * shortest_microbatch_s(workload, budget_bytes, own, ease) + tail

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
