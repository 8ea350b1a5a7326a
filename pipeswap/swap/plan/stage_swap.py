"""Stages that swap: which layers' saved tensors a stage sends to host or recomputes, per unit.

A stage holds the saved tensors of every unit in flight (stage 0 of 1F1B holds K). A
:class:`StagePlan` says, for every unit alike, which layers' saved tensors go to host
memory after the unit's forward (one d2h, freeing them) and come back before its
backward (one h2d, issued once the ``lead``-th compute action before that backward has
ended), and which layers are recomputed right before the backward instead (their
forward again, holding only their input in between). The plan is made from the stage's
own timeline: its compute actions in schedule order, which say when each unit's
backward comes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import Schedule
from pipeswap.swap.plan.stage_costs import StageCosts

__all__ = [
    "LEADS",
    "NO_PLAN",
    "StageAction",
    "StagePlan",
    "UnitMemory",
    "floor_bytes",
    "floor_plan",
    "memory_by_action",
    "peak_bytes",
    "plan_stage",
    "prefetch_points",
    "stage_order",
    "unit_memory",
]

# Prefetch leads tried, latest first: lead 1 issues the copy when the action right before
# the backward ends (the backward then waits for all of it), so plans start at 2.
LEADS = (2, 3, 4)

# One compute action of a stage: (F, B or UPDATE, its unit or step).
StageAction = tuple[ActionKind, int]


@dataclass(frozen=True)
class StagePlan:
    """Per unit: the layers (model indices) swapped and recomputed, and the prefetch lead."""

    swapped: frozenset[int] = frozenset()
    recomputed: frozenset[int] = frozenset()
    lead: int = LEADS[0]

    @property
    def empty(self) -> bool:
        return not self.swapped and not self.recomputed


NO_PLAN = StagePlan()


@dataclass(frozen=True)
class UnitMemory:
    """What one unit of a stage under a plan holds: ``held`` from its forward to its
    backward, ``swap`` of it on host in between, ``rerun`` allocated by the recompute
    right before the backward; ``recompute_s`` the recompute's time. ``rerun_layer``:
    the most one recomputed layer's forward allocates and lets go as it ends (its forward
    saves nothing, but computes all it would have saved)."""

    held: int
    swap: int
    rerun: int
    recompute_s: float
    rerun_layer: int = 0

    @property
    def recomputes(self) -> bool:
        return self.recompute_s > 0 or self.rerun > 0

    @property
    def full(self) -> int:
        """What the forward allocates: held and swapped bytes together."""
        return self.held + self.swap


def unit_memory(costs: StageCosts, plan: StagePlan) -> UnitMemory:
    held = costs.unit_extra_bytes  # the unit's input and outputs: never swapped
    swap = rerun = rerun_layer = 0
    recompute_s = 0.0
    for i, layer in enumerate(costs.layers):
        if layer in plan.recomputed:
            held += costs.kept[i]
            rerun += costs.rerun[i]
            rerun_layer = max(rerun_layer, costs.rerun[i])
            recompute_s += costs.layer_forward_s[i]
        elif layer in plan.swapped:
            swap += costs.saved[i]
        else:
            held += costs.saved[i]
    return UnitMemory(held, swap, rerun, recompute_s, rerun_layer)


def stage_order(schedule: Schedule, stage: int) -> list[StageAction]:
    """The compute actions of ``stage`` in the order it runs them."""
    return [(a.kind, a.unit) for a in schedule.compute_actions(stage)]


def prefetch_points(order: Sequence[StageAction], lead: int) -> dict[int, int]:
    """Per unit, the position in ``order`` after which its prefetch is issued: ``lead``
    actions before its backward, but never before its own forward."""
    forward = {u: i for i, (kind, u) in enumerate(order) if kind is ActionKind.F}
    return {
        u: max(forward[u], i - lead)
        for i, (kind, u) in enumerate(order)
        if kind is ActionKind.B and u in forward
    }


def memory_by_action(order: Sequence[StageAction], costs: StageCosts, plan: StagePlan) -> list[int]:
    """Worst-case memory of the stage while each action of ``order`` runs.

    A unit holds everything during its forward (a recomputed layer's tensors until that
    layer ends), and its swapped bytes also during the next action (the copy may still
    run), and again from its prefetch's issue on; during its backward it holds the
    recompute's tensors; a forward holds the stage's largest forward working set, a
    backward its largest backward one (a recompute's forward's if larger) and the weight
    mode's copy of a pass (``pass_copy_bytes``), an update its temporaries. The simulator
    makes a pass wait for memory a copy still holds, so a plan within the budget here
    never runs out of memory there.
    """
    unit = unit_memory(costs, plan)
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    for i, (kind, u) in enumerate(order):
        if kind is ActionKind.F:
            forward[u] = i
        elif kind is ActionKind.B:
            backward[u] = i
    issue = prefetch_points(order, plan.lead)
    memory = [
        costs.resident_bytes + (costs.update_transient_bytes if kind is ActionKind.UPDATE else 0)
        for kind, _ in order
    ]
    backward_working = costs.backward_working_bytes
    if unit.recomputes:
        backward_working = max(backward_working, costs.transient_bytes)
    backward_working += costs.pass_copy_bytes
    for u, f in forward.items():
        b = backward.get(u, len(order) - 1)
        for p in range(f, b + 1):
            held = unit.held
            if p <= f + 1 or p > issue.get(u, b):
                held += unit.swap
            if p == f:
                held += costs.transient_bytes + unit.rerun_layer
            if p == b and u in backward:
                held += unit.rerun + backward_working
            memory[p] += held
    return memory


def peak_bytes(order: Sequence[StageAction], costs: StageCosts, plan: StagePlan) -> int:
    return max(memory_by_action(order, costs, plan), default=costs.resident_bytes)


def plan_stage(
    order: Sequence[StageAction],
    costs: StageCosts,
    budget_bytes: int,
    *,
    allowance_bytes: float,
    bytes_per_s: float,
    swap: bool = True,
    recompute: bool = True,
) -> StagePlan | None:
    """The cheapest plan found that keeps the stage within ``budget_bytes`` (None: none).

    Greedy over layers: each round adds the swap of the largest remaining layer or the
    recompute of the layer that frees memory most cheaply, whichever costs less time per
    byte of peak it removes. A swap within ``allowance_bytes`` per unit (what the stage's
    share of its PCIe path carries while the pipeline runs one unit) costs nothing; bytes
    beyond it cost their copy time at ``bytes_per_s``. A recompute costs the layer's
    forward. The prefetch is then issued as early as the budget allows. ``swap`` and
    ``recompute`` False leave out that kind of move.
    """
    plan = NO_PLAN
    peak = peak_bytes(order, costs, plan)
    while peak > budget_bytes:
        best: tuple[float, StagePlan, int] | None = None
        moves = _next_moves(costs, plan, allowance_bytes, bytes_per_s, swap, recompute)
        for candidate, cost in moves:
            new_peak = peak_bytes(order, costs, candidate)
            if new_peak >= peak:
                continue
            value = cost / (peak - new_peak)
            if best is None or value < best[0]:
                best = (value, candidate, new_peak)
        if best is None:
            # Greedy got stuck; the floor's plan is the last resort (it fits iff the
            # budget is at least floor_bytes).
            last = floor_plan(costs, swap=swap, recompute=recompute)
            return last if peak_bytes(order, costs, last) <= budget_bytes else None
        _, plan, peak = best
    for lead in LEADS[1:]:
        later = StagePlan(plan.swapped, plan.recomputed, lead)
        if not plan.swapped or peak_bytes(order, costs, later) > budget_bytes:
            break
        plan = later
    return plan


def _next_moves(
    costs: StageCosts,
    plan: StagePlan,
    allowance_bytes: float,
    bytes_per_s: float,
    swap: bool,
    recompute: bool,
) -> list[tuple[StagePlan, float]]:
    """The largest swap and the cheapest recompute not in ``plan``, with their time cost."""
    moves: list[tuple[StagePlan, float]] = []
    free = [
        i
        for i, layer in enumerate(costs.layers)
        if layer not in plan.swapped and layer not in plan.recomputed
    ]
    swappable = [i for i in free if costs.saved[i] > 0] if swap else []
    if swappable:
        i = max(swappable, key=lambda j: (costs.saved[j], -j))
        before = unit_memory(costs, plan).swap
        after = before + costs.saved[i]
        cost = (
            max(0.0, after - allowance_bytes) - max(0.0, before - allowance_bytes)
        ) / bytes_per_s
        moves.append(
            (StagePlan(plan.swapped | {costs.layers[i]}, plan.recomputed, plan.lead), cost)
        )
    freeing = [i for i in free if costs.saved[i] > costs.kept[i]] if recompute else []
    if freeing:
        i = min(
            freeing,
            key=lambda j: (costs.layer_forward_s[j] / (costs.saved[j] - costs.kept[j]), j),
        )
        moves.append(
            (
                StagePlan(plan.swapped, plan.recomputed | {costs.layers[i]}, plan.lead),
                costs.layer_forward_s[i],
            )
        )
    return moves


def floor_plan(costs: StageCosts, *, swap: bool = True, recompute: bool = True) -> StagePlan:
    """Every layer recomputed where that frees memory, the others swapped, prefetched at
    the last moment: the plan holding the least (with only the moves allowed)."""
    recomputed = frozenset(
        layer
        for i, layer in enumerate(costs.layers)
        if recompute and costs.kept[i] < costs.saved[i]
    )
    swapped = frozenset(costs.layers) - recomputed if swap else frozenset()
    return StagePlan(swapped, recomputed, 1)


def floor_bytes(
    order: Sequence[StageAction], costs: StageCosts, *, swap: bool = True, recompute: bool = True
) -> int:
    """The peak of :func:`floor_plan`: :func:`plan_stage` finds a plan for any budget at
    least this."""
    return peak_bytes(order, costs, floor_plan(costs, swap=swap, recompute=recompute))
