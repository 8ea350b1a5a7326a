"""The mip policy: a mixed-integer program (HiGHS) per channel group of GPUs.

It chooses which tensors each GPU swaps and which layers the channel's GPUs recompute.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan.case import Case, all_tensors
from pipeswap.swap.plan.channels import channel_groups, group_shape, path_bytes_per_s, shared_links
from pipeswap.swap.plan.hybrid import hybrid
from pipeswap.swap.plan.policies import SWAP_ONLY, fits, heuristic, with_prefetch
from pipeswap.swap.plan.refused import BudgetRefused
from pipeswap.swap.plan.scoring import Assignment, Scored
from pipeswap.swap.plan.solver import quiet_highs
from pipeswap.swap.plan.tensors import SMALLEST_TENSOR_BYTES, SavedTensorAt, SwapDecisionAt
from pipeswap.units import format_bytes

__all__ = ["GB", "GroupSolution", "MipOutcome", "plan_mip", "solve_group"]

GB = 1e9  # the model counts bytes in GB and time in seconds, so coefficients stay near 1


@dataclass(frozen=True)
class GroupSolution:
    """The MIP's answer for one channel group: a tensor set per member, the layers every
    member recomputes, and its numbers."""

    choice: list[list[SavedTensorAt]]
    stall_s: float  # predicted stall per micro-batch
    mip_gap: float
    status: str
    binaries: int
    recompute: frozenset[int] = frozenset()
    recompute_s: float = 0.0  # per micro-batch


@dataclass(frozen=True)
class MipOutcome:
    scored: Scored
    mip_gap: float | None
    notes: dict[str, Any] = field(default_factory=dict)


def _group_key(case: Case, group: Sequence[str]) -> tuple[Any, ...]:
    # Channel groups with the same shape get the same solution (presets repeat shapes).
    return group_shape(case.topology, group)


def solve_group(
    case: Case,
    group: Sequence[str],
    warm: Sequence[Sequence[SavedTensorAt]] | None,
    *,
    time_limit_s: float,
    warm_recompute: frozenset[int] = frozenset(),
) -> GroupSolution:
    """Choose each member's swapped tensors, and the layers the members recompute, to
    minimize the predicted stall plus recompute time of one micro-batch.

    Intervals are the forward and backward passes of the micro-batch (the members run in step).
    Per member and interval, continuous swap-out and prefetch volumes; binaries choose the
    tensors, and per layer whether the group recomputes it (a recomputed layer swaps
    nothing, frees ``Workload.freed_bytes`` from its forward on, and its backward interval
    lasts its forward longer, with the re-run's saved tensors held at that interval: the
    memory model of ``Workload``). Constraints: a tensor moves out only after its
    forward; memory within budget at every forward and backward step; every tensor back
    before its backward; each direction of every link carries at most bandwidth x (interval
    time + stall) per interval. Objective: the sum of the intervals' stalls and recompute times.
    """
    import highspy  # here, not at the top: HiGHS loads only when a MIP is solved

    workload = case.workload
    n = workload.num_layers
    needs = [need / GB for need in workload.needs(case.budget_bytes)]
    last_short = max((i for i, need in enumerate(needs) if need > 0), default=-1)
    candidates = [
        t
        for t in all_tensors(workload)
        if t.layer < last_short and t.bytes >= SMALLEST_TENSOR_BYTES
    ]
    # Unclipped needs (a recomputed layer's backward may need memory where none was short).
    raw = [
        (workload.resident_bytes + point - case.budget_bytes) / GB for point in _points(workload)
    ]
    freed = [b / GB for b in workload.freed_bytes]
    inputs = workload.input_saved or (0,) * n
    over = [(k - i) / GB for k, i in zip(workload.kept_bytes, inputs)]
    layers = [i for i in range(last_short) if workload.freed_bytes[i] >= SMALLEST_TENSOR_BYTES]
    members = list(group)
    if last_short < 0 or not (candidates or layers):
        return GroupSolution([[] for _ in members], 0.0, 0.0, "nothing to swap", 0)
    durations = list(workload.forward_s) + [workload.backward_s[j] for j in reversed(range(n))]
    intervals = len(durations)
    backward_interval = {j: 2 * n - 1 - j for j in range(n)}

    h = quiet_highs(time_limit_s=time_limit_s)
    inf = highspy.kHighsInf
    # Each interval is a stall (a wait before its compute starts) then its compute: phase 2s
    # lasts stall[s], phase 2s+1 lasts durations[s]. Copies flow in both phases.
    stall = [h.addVariable(lb=0.0, ub=inf) for _ in range(intervals)]
    rec = {i: h.addVariable(lb=0.0, ub=1.0, type=highspy.HighsVarType.kInteger) for i in layers}
    phases = 2 * intervals
    x = [
        [h.addVariable(lb=0.0, ub=1.0, type=highspy.HighsVarType.kInteger) for _ in candidates]
        for _ in members
    ]
    out = [[h.addVariable(lb=0.0, ub=inf) for _ in range(phases)] for _ in members]
    inn = [[h.addVariable(lb=0.0, ub=inf) for _ in range(phases)] for _ in members]
    sizes = [t.bytes / GB for t in candidates]

    def swapped(m: int, layers: range) -> Any:
        return h.qsum(sizes[k] * x[m][k] for k, t in enumerate(candidates) if t.layer in layers)

    interval_layer = {backward_interval[j]: j for j in range(n)}

    def window(phase: int) -> Any:
        if phase % 2 == 0:
            return stall[phase // 2]
        layer = interval_layer.get(phase // 2)
        if layer in rec:  # a recomputed layer's backward interval runs its forward first
            return durations[phase // 2] + workload.forward_s[layer] * rec[layer]
        return durations[phase // 2]

    def freed_through(last: int) -> Any:
        """Bytes (GB) the recomputed layers <= ``last`` free in the forward."""
        return h.qsum(freed[i] * rec[i] for i in layers if i <= last)

    for k, t in enumerate(candidates):
        if t.layer in rec:
            for m in range(len(members)):
                h.addConstr(x[m][k] + rec[t.layer] <= 1)

    for m in range(len(members)):
        total = swapped(m, range(n))
        cum_out: Any = 0.0
        cum_in: Any = 0.0
        outs_before: list[Any] = []  # completed before each phase starts
        ins_before: list[Any] = []
        for phase in range(phases):
            outs_before.append(cum_out)
            ins_before.append(cum_in)
            cum_out = cum_out + out[m][phase]
            cum_in = cum_in + inn[m][phase]
            interval = phase // 2
            if interval < n:
                # Only tensors of layers before this forward interval can be on their way out.
                h.addConstr(cum_out - swapped(m, range(interval)) <= 0)
            # Nothing comes back before it has gone.
            h.addConstr(cum_in - outs_before[phase] <= 0)
        h.addConstr(cum_out - total == 0)
        h.addConstr(cum_in - total == 0)
        for i in range(n):
            run_f = 2 * i + 1
            run_b = 2 * backward_interval[i] + 1
            if raw[i] > 0:
                h.addConstr(outs_before[run_f] + freed_through(i) >= raw[i])
            extra = over[i] * rec[i] if i in rec else 0.0
            if raw[i] + (max(over[i], 0.0) if i in rec else 0.0) > 0:
                h.addConstr(
                    outs_before[run_b] - ins_before[run_b] + freed_through(i - 1) - extra >= raw[i]
                )
            later = swapped(m, range(i, n))
            h.addConstr(ins_before[run_b] - later >= 0)
    # Bandwidth per phase: each member's own path, and each link members share.
    for m, gpu in enumerate(members):
        own = path_bytes_per_s(case.topology, gpu) / GB
        single_engine = case.topology.node(gpu).copy_engines == 1
        for phase in range(phases):
            if single_engine:
                h.addConstr(out[m][phase] + inn[m][phase] - own * window(phase) <= 0)
            else:
                h.addConstr(out[m][phase] - own * window(phase) <= 0)
                h.addConstr(inn[m][phase] - own * window(phase) <= 0)
    for link, users in shared_links(case.topology, members).items():
        capacity = case.topology.links[link].bytes_per_s / GB
        idx = [members.index(g) for g in users]
        for phase in range(phases):
            h.addConstr(h.qsum(out[m][phase] for m in idx) - capacity * window(phase) <= 0)
            h.addConstr(h.qsum(inn[m][phase] for m in idx) - capacity * window(phase) <= 0)
    # A tiny price on moved bytes keeps the plan from swapping what it does not need to.
    tiny = 1e-6
    objective = (
        h.qsum(stall)
        + h.qsum(workload.forward_s[i] * rec[i] for i in layers)
        + tiny
        * h.qsum(sizes[k] * x[m][k] for m in range(len(members)) for k in range(len(candidates)))
    )
    if warm is not None:
        chosen = [{(t.layer, t.index) for t in member} for member in warm]
        index = [x[m][k].index for m in range(len(members)) for k in range(len(candidates))]
        values = [
            1.0 if (t.layer, t.index) in chosen[m] else 0.0
            for m in range(len(members))
            for t in candidates
        ]
        index += [rec[i].index for i in layers]
        values += [1.0 if i in warm_recompute else 0.0 for i in layers]
        h.setSolution(len(index), np.array(index, dtype=np.int32), np.array(values))
    h.minimize(objective)
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible solution found in time
        return GroupSolution(
            [list(w) for w in warm] if warm else [[] for _ in members],
            math.inf,
            math.inf,
            status,
            len(members) * len(candidates),
        )
    solved = h.vals([v for row in x for v in row])
    choice: list[list[SavedTensorAt]] = []
    for m in range(len(members)):
        row = solved[m * len(candidates) : (m + 1) * len(candidates)]
        choice.append([t for t, v in zip(candidates, row) if v > 0.5])
    recomputed = frozenset(i for i, v in zip(layers, h.vals([rec[i] for i in layers])) if v > 0.5)
    stall_s = float(sum(h.vals(stall)))
    gap = float(info.mip_gap) if math.isfinite(info.mip_gap) else math.inf
    return GroupSolution(
        choice,
        stall_s,
        max(0.0, gap),
        status,
        len(members) * len(candidates) + len(layers),
        recomputed,
        sum(workload.forward_s[i] for i in recomputed),
    )


def _points(workload: Any) -> list[int]:
    # Memory of every layer with nothing swapped or recomputed, above resident state.
    points, cumulative = [], 0
    for saved, forward, backward in zip(
        workload.all_saved_bytes, workload.forward_working, workload.backward_working
    ):
        cumulative += saved
        points.append(cumulative + max(forward, backward))
    return points


def _fits(case: Case, tensors: Sequence[SavedTensorAt], recompute: frozenset[int]) -> bool:
    latest = [SwapDecisionAt.latest(t) for t in tensors]
    return case.workload.recomputing(recompute).fits(latest, case.budget_bytes)


def plan_mip(case: Case, *, time_limit_s: float) -> MipOutcome:
    """Solve the MIP per channel group, warm-started from the best heuristic plan.

    The MIP's plan is re-scored by the simulator; when it simulates slower than the warm
    start, the warm start is returned. Both estimates are in the notes. The outcome is
    remembered on ``case`` (``auto`` starts from it).
    """
    return case.remembered(("mip", time_limit_s), lambda: _plan_mip(case, time_limit_s))


def _plan_mip(case: Case, time_limit_s: float) -> MipOutcome:
    started = time.perf_counter()
    # The warm start: the fastest heuristic plan that fits (near the smallest budget the
    # swap-only ones cannot: simulating one that does not fit would end the search).
    heuristics: dict[str, Scored] = {}
    for name in (*SWAP_ONLY, "hybrid", "recompute", "save-on-cpu"):
        try:
            assignment = hybrid(case) if name == "hybrid" else heuristic(case, name)
        except PipeswapError:  # no plan of that heuristic fits
            continue
        if fits(case, assignment):
            heuristics[name] = case.score(assignment)
    if not heuristics:
        raise BudgetRefused(
            f"no heuristic plan fits a budget of {case.budget_bytes} bytes "
            f"({format_bytes(case.budget_bytes)}) for the search to start from",
            floor=case.budget_bytes,
            peak=case.workload.no_swap_peak_bytes(),
            smallest=None,
        )
    warm_name = min(heuristics, key=lambda name: heuristics[name].iteration_s)
    warm = heuristics[warm_name]
    groups = channel_groups(case.topology, case.gpus)
    solved: dict[tuple[Any, ...], GroupSolution] = {}
    choice: dict[str, list[SavedTensorAt]] = {}
    recompute: dict[str, frozenset[int]] = {}
    stalls: list[float] = []
    gaps: list[float] = []
    statuses: list[str] = []
    sizes = {(t.layer, t.index): t for t in all_tensors(case.workload)}  # nothing recomputed
    deadline = started + time_limit_s
    for group in groups:
        key = _group_key(case, group)
        if key not in solved:
            warm_sets = [
                [sizes[(s.layer, s.index)] for s in warm.assignment.swaps.get(g, ())] for g in group
            ]
            # The MIP gives every member of a group one recompute set: start from the
            # first member's.
            warm_recompute = warm.assignment.recomputed(group[0])
            remaining = max(1.0, deadline - time.perf_counter())
            solved[key] = solve_group(
                case, group, warm_sets, time_limit_s=remaining, warm_recompute=warm_recompute
            )
            stalls.append(solved[key].stall_s + solved[key].recompute_s)
            gaps.append(solved[key].mip_gap)
            statuses.append(solved[key].status)
        for gpu, tensors in zip(group, solved[key].choice):
            choice[gpu] = tensors
            recompute[gpu] = solved[key].recompute
    candidates: dict[str, Scored] = {}
    if all(_fits(case, choice[g], recompute[g]) for g in case.gpus):
        swaps = {
            g: with_prefetch(case.workload.recomputing(recompute[g]), choice[g], case.budget_bytes)
            for g in case.gpus
        }
        layers = {g: r for g, r in recompute.items() if r}
        candidates["mip"] = case.score(Assignment(swaps, recompute=layers))
        if warm.assignment.offsets_s:
            candidates["mip+offsets"] = case.score(
                Assignment(swaps, warm.assignment.offsets_s, layers)
            )
    stall_per_micro = max(stalls, default=0.0)
    mip_estimate_s = case.workload.compute_s(case.sync_every) + case.sync_every * stall_per_micro
    notes: dict[str, Any] = {
        "warm_start": warm_name,
        "warm_start_iteration_s": warm.iteration_s,
        "mip_estimate_s": mip_estimate_s,
        "solver_status": ", ".join(sorted(set(statuses))) or "nothing to solve",
        "groups_solved": len(solved),
    }
    best_name, best = warm_name, warm
    for name, scored in candidates.items():
        notes[f"{name}_simulated_s"] = scored.iteration_s
        if scored.iteration_s < best.iteration_s:
            best_name, best = name, scored
    notes["kept"] = best_name if best_name.startswith("mip") else f"warm start ({warm_name})"
    finite = [g for g in gaps if math.isfinite(g)]
    mip_gap = max(finite) if finite else (None if not gaps else math.inf)
    return MipOutcome(best, mip_gap, notes)
