"""The rule-based policies: none, oblivious, disjoint, bidirectional, recompute, save-on-cpu."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan.case import Case, all_tensors
from pipeswap.swap.plan.channels import channel_groups, path_bytes_per_s
from pipeswap.swap.plan.scoring import Assignment
from pipeswap.swap.plan.tensors import SavedTensorAt, SwapDecisionAt
from pipeswap.swap.plan.workload import Workload

__all__ = [
    "HEURISTICS",
    "SWAP_ONLY",
    "Coverage",
    "bidirectional_offsets",
    "disjoint_choice",
    "fits",
    "heuristic",
    "late_members",
    "need_bytes",
    "plan_bidirectional",
    "plan_disjoint",
    "plan_none",
    "plan_oblivious",
    "plan_recompute",
    "plan_save_on_cpu",
    "timeline",
    "with_best_offset",
    "with_prefetch",
]


# ---- building blocks ---------------------------------------------------------------------
def timeline(workload: Workload) -> tuple[list[float], list[float]]:
    """Per layer: when its forward ends and when its backward starts (no stalls)."""
    forward_end: list[float] = []
    now = 0.0
    for seconds in workload.forward_s:
        now += seconds
        forward_end.append(now)
    backward_start = [0.0] * workload.num_layers
    for layer in reversed(range(workload.num_layers)):
        backward_start[layer] = now
        now += workload.backward_s[layer]
    return forward_end, backward_start


class Coverage:
    """How far one GPU's chosen swaps are from meeting ``Workload.needs``."""

    def __init__(self, needs: Sequence[int]) -> None:
        self.needs = list(needs)
        self.removed_before = [0] * len(needs)  # swapped bytes of layers < i
        self._refresh()

    def _refresh(self) -> None:
        # The last layer whose need is unmet: a tensor helps iff its layer is before it.
        self.last_short = -1
        for i, (need, removed) in enumerate(zip(self.needs, self.removed_before)):
            if need > removed:
                self.last_short = i

    @property
    def met(self) -> bool:
        return self.last_short < 0

    @property
    def shortfall(self) -> int:
        return max((n - r for n, r in zip(self.needs, self.removed_before)), default=0)

    def helps(self, layer: int) -> bool:
        return layer < self.last_short

    def add(self, layer: int, nbytes: int) -> None:
        for i in range(layer + 1, len(self.needs)):
            self.removed_before[i] += nbytes
        self._refresh()


def with_prefetch(
    workload: Workload, chosen: Sequence[SavedTensorAt], budget_bytes: int
) -> tuple[SwapDecisionAt, ...]:
    """Swaps issued right after their forward, prefetched as early as memory allows.

    Tensors needed first claim memory first; each prefetch moves earlier one backward
    step at a time while every backward point it would overlap stays within budget.
    """
    n = workload.num_layers
    latest = [SwapDecisionAt.latest(t) for t in chosen]
    _, backward = workload.memory_points(latest)
    if max(backward, default=0) > budget_bytes:
        raise PipeswapError("internal: chosen swaps do not fit the budget")  # pragma: no cover
    swaps: list[SwapDecisionAt] = []
    for s in sorted(latest, key=lambda s: (-s.layer, -s.bytes, s.index)):
        point = s.layer + 1
        while point < n and backward[point] + s.bytes <= budget_bytes:
            backward[point] += s.bytes
            point += 1
        swaps.append(SwapDecisionAt(s.layer, s.index, s.bytes, s.layer, point))
    return tuple(sorted(swaps, key=lambda s: (s.layer, s.index)))


def _fill(coverage: Coverage, order: Sequence[SavedTensorAt], chosen: list[SavedTensorAt]) -> None:
    for tensor in order:
        if coverage.met:
            return
        if coverage.helps(tensor.layer) and tensor not in chosen:
            chosen.append(tensor)
            coverage.add(tensor.layer, tensor.bytes)


# ---- the policies --------------------------------------------------------------------------
def plan_none(case: Case) -> Assignment:
    """No swapping at all."""
    return Assignment({gpu: () for gpu in case.gpus})


def plan_oblivious(case: Case) -> Assignment:
    """Each GPU plans as if it owned its whole path to host; every GPU gets that plan.

    Largest saved tensors first, among those whose forward-to-backward distance hides
    the swap-out and the prefetch at full bandwidth; then the others, largest first,
    until the peak fits.
    """
    workload = case.workload
    bandwidth = path_bytes_per_s(case.topology, case.gpus[0])
    forward_end, backward_start = timeline(workload)
    by_size = sorted(all_tensors(workload), key=lambda t: (-t.bytes, t.layer, t.index))

    def hidden(t: SavedTensorAt) -> bool:
        return backward_start[t.layer] - forward_end[t.layer] >= 2 * t.bytes / bandwidth

    order = [t for t in by_size if hidden(t)] + [t for t in by_size if not hidden(t)]
    coverage = Coverage(workload.needs(case.budget_bytes))
    chosen: list[SavedTensorAt] = []
    _fill(coverage, order, chosen)
    swaps = with_prefetch(workload, chosen, case.budget_bytes)
    return Assignment({gpu: swaps for gpu in case.gpus})


def disjoint_choice(
    workload: Workload, members: int, budget_bytes: int
) -> list[list[SavedTensorAt]]:
    """SavedTensorAt sets for ``members`` GPUs sharing a channel, disjoint where possible.

    The tensors produced before memory first gets tight are dealt out one at a time, in
    forward order (longest forward-to-backward distance first), to the member furthest
    from fitting: members swap different tensors at different moments, so their
    transfers take turns on the channel instead of colliding. What a member still lacks
    is then taken in forward order, shared with the others where it must be.
    """
    needs = workload.needs(budget_bytes)
    first_tight = next((i for i, need in enumerate(needs) if need > 0), len(needs))
    order = sorted(all_tensors(workload), key=lambda t: (t.layer, -t.bytes, t.index))
    coverages = [Coverage(needs) for _ in range(members)]
    chosen: list[list[SavedTensorAt]] = [[] for _ in range(members)]
    for tensor in order:
        if tensor.layer >= first_tight:
            break
        open_members = [m for m in range(members) if coverages[m].helps(tensor.layer)]
        if not open_members:
            break
        member = max(open_members, key=lambda m: (coverages[m].shortfall, -m))
        chosen[member].append(tensor)
        coverages[member].add(tensor.layer, tensor.bytes)
    for member in range(members):
        _fill(coverages[member], order, chosen[member])
    return chosen


def plan_disjoint(case: Case, recompute: Collection[int] = ()) -> Assignment:
    """GPUs that share a channel swap disjoint tensors, taking turns on the channel.

    ``recompute``: layers every GPU recomputes; the swaps cover what they leave to free.
    """
    workload = case.workload.recomputing(recompute)
    swaps: dict[str, tuple[SwapDecisionAt, ...]] = {}
    for group in channel_groups(case.topology, case.gpus):
        choice = disjoint_choice(workload, len(group), case.budget_bytes)
        for gpu, tensors in zip(group, choice):
            swaps[gpu] = with_prefetch(workload, tensors, case.budget_bytes)
    return Assignment(swaps, recompute=_everywhere(case, recompute))


def _everywhere(case: Case, recompute: Collection[int]) -> dict[str, frozenset[int]]:
    layers = frozenset(recompute)
    return {gpu: layers for gpu in case.gpus} if layers else {}


def bidirectional_offsets(workload: Workload, swap_out_s: float = 0.0) -> list[float]:
    """Offsets tried first for the late GPUs: half to twice a forward pass, half a
    micro-batch, and ``swap_out_s`` (the time one GPU's swap-outs take alone) and a
    little more: the phases swap over when the offset covers the early GPU's swap-outs."""
    forward = sum(workload.forward_s)
    candidates = {round(f * forward, 9) for f in (0.5, 0.75, 1.0, 1.5, 2.0)}
    candidates.add(round(workload.microbatch_s / 2, 9))
    candidates |= {round(f * swap_out_s, 9) for f in (1.0, 1.1)}
    return sorted(c for c in candidates if c > 0)


def plan_bidirectional(case: Case, recompute: Collection[int] = ()) -> Assignment:
    """Alternate GPUs of each channel start later by an offset, so one GPU's swap-outs
    run while its neighbour's prefetches run, on the two directions of the link.

    Within each phase the GPUs swap disjoint tensors. The offset is paid again at every
    gradient sync; ``with_best_offset`` chooses it by simulation. ``recompute``: layers
    every GPU recomputes.
    """
    workload = case.workload.recomputing(recompute)
    layers = _everywhere(case, recompute)
    swaps: dict[str, tuple[SwapDecisionAt, ...]] = {}
    late: list[str] = []
    for group in channel_groups(case.topology, case.gpus):
        phases = [group[0::2], group[1::2]]
        late.extend(phases[1])
        for phase in phases:
            if not phase:
                continue
            choice = disjoint_choice(workload, len(phase), case.budget_bytes)
            for gpu, tensors in zip(phase, choice):
                swaps[gpu] = with_prefetch(workload, tensors, case.budget_bytes)
    if not late or not any(swaps.values()):
        # Nothing shares a channel, or nothing moves: no offset.
        return Assignment(swaps, recompute=layers)
    return with_best_offset(case, swaps, late, recompute=layers)


def late_members(case: Case) -> list[str]:
    """The GPUs ``bidirectional`` starts late: every second GPU of each channel group."""
    return [gpu for group in channel_groups(case.topology, case.gpus) for gpu in group[1::2]]


def with_best_offset(
    case: Case,
    swaps: Mapping[str, tuple[SwapDecisionAt, ...]],
    late: Sequence[str],
    recompute: Mapping[str, frozenset[int]] | None = None,
) -> Assignment:
    """``swaps`` with the start offset of the ``late`` GPUs that simulates fastest.

    Candidate offsets are ranked by simulating at most two micro-batches of one channel
    group when all groups have one shape (the all-reduce then spans that group only),
    else of the whole case; the planner simulates the chosen plan on the whole case.
    """
    # Two micro-batches show what an offset costs and what it buys in the steady state;
    # more only repeat the second, so candidates are ranked on at most two.
    ranking = replace(case.reduced(), sync_every=min(case.sync_every, 2))
    recompute = dict(recompute or {})

    def trial_s(offset: float) -> float:
        trial = Assignment(swaps, {gpu: offset for gpu in late if gpu in ranking.gpus}, recompute)
        return ranking.score(trial).iteration_s

    view = case.workload.recomputing(recompute.get(late[0], ()))
    deficit = max(0, view.no_swap_peak_bytes() - case.budget_bytes)
    swap_out_s = deficit / path_bytes_per_s(case.topology, late[0])
    tried = {o: trial_s(o) for o in bidirectional_offsets(case.workload, swap_out_s)}
    # Then narrow in around the best: halve the step twice on each side.
    step = sum(case.workload.forward_s) / 8
    for _ in range(2):
        best = min(tried, key=lambda o: (tried[o], o))
        for offset in (best - step, best + step):
            if offset > 0 and round(offset, 9) not in tried:
                tried[round(offset, 9)] = trial_s(round(offset, 9))
        step /= 2
    best = min(tried, key=lambda o: (tried[o], o))
    return Assignment(swaps, {gpu: best for gpu in late}, recompute)


def plan_recompute(case: Case) -> Assignment:
    """Recomputation of every block, nothing swapped (the baseline users write with
    ``torch.utils.checkpoint``): each GPU keeps only every layer's input. It may not
    fit the budget (the planner then says so). A layer that keeps state past its forward
    (``Workload.held_state``) is kept whole: recomputing it would free nothing."""
    return Assignment(
        {gpu: () for gpu in case.gpus}, recompute=_everywhere(case, case.workload.recomputable)
    )


def plan_save_on_cpu(case: Case) -> Assignment:
    """``torch.autograd.graph.save_on_cpu``: every saved tensor goes to host right after
    its layer's forward and comes back when its backward needs it (the prefetch is issued
    after the next layer's backward, so the backward waits for the whole copy); no GPU
    coordinates with another, no offsets. Copies are asynchronous here, which favours the
    baseline: torch's pack hook copies on the compute stream."""
    swaps = tuple(SwapDecisionAt.latest(t) for t in all_tensors(case.workload))
    return Assignment({gpu: swaps for gpu in case.gpus})


def need_bytes(case: Case, assignment: Assignment) -> int:
    """The most any GPU of ``assignment`` holds at once (``Workload.need_bytes``): the
    smallest budget it fits."""
    return max(
        case.workload.selecting(assignment.selective)
        .recomputing(assignment.recomputed(gpu))
        .need_bytes(assignment.swaps.get(gpu, ()))
        for gpu in case.gpus
    )


def fits(case: Case, assignment: Assignment) -> bool:
    """Whether every GPU of ``assignment`` stays within the budget."""
    return need_bytes(case, assignment) <= case.budget_bytes


def heuristic(case: Case, name: str) -> Assignment:
    """The assignment of the heuristic ``name`` (one of :data:`HEURISTICS`) on ``case``,
    made once per case."""
    return case.remembered(("heuristic", name), lambda: HEURISTICS[name](case))


# The heuristics that plan by rule alone (hybrid builds on them: pipeswap.swap.plan.hybrid).
HEURISTICS: dict[str, Callable[[Case], Assignment]] = {
    "none": plan_none,
    "oblivious": plan_oblivious,
    "disjoint": plan_disjoint,
    "bidirectional": plan_bidirectional,
    "recompute": plan_recompute,
    "save-on-cpu": plan_save_on_cpu,
}
# The policies that only swap (what hybrid must beat or match).
SWAP_ONLY = ("oblivious", "disjoint", "bidirectional")
