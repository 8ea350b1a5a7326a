"""The offline policy: a mixed-integer program over the GPUs of each channel (HiGHS)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeswap.swap.case import Case, Tensor, all_tensors
from pipeswap.swap.channels import group_shape, path_bytes_per_s, shared_links
from pipeswap.swap.policies import HEURISTICS, with_prefetch
from pipeswap.swap.scoring import Assignment, Scored
from pipeswap.swap.workload import Swap

GB = 1e9  # the model counts bytes in GB and time in seconds, so coefficients stay near 1
_SMALLEST_TENSOR_BYTES = 2**20  # smaller tensors cannot change a plan measurably


@dataclass(frozen=True)
class GroupSolution:
    """The MIP's answer for one channel group: a tensor set per member, and its numbers."""

    choice: list[list[Tensor]]
    stall_s: float  # predicted stall per micro-batch
    mip_gap: float
    status: str
    binaries: int


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
    warm: Sequence[Sequence[Tensor]] | None,
    *,
    time_limit_s: float,
) -> GroupSolution:
    """Choose each member's swapped tensors to minimize the predicted stall of one micro-batch.

    Slots are the forward and backward steps of the micro-batch (the members run in step).
    Per member and slot, continuous swap-out and prefetch volumes; binaries choose the
    tensors. Constraints: a tensor moves out only after its forward; memory within budget
    at every forward and backward step; every tensor back before its backward; each
    direction of every link carries at most bandwidth x (slot time + stall) per slot.
    Objective: the sum of the slots' stalls.
    """
    import highspy

    workload = case.workload
    n = workload.num_layers
    needs = [need / GB for need in workload.needs(case.budget_bytes)]
    last_short = max((i for i, need in enumerate(needs) if need > 0), default=-1)
    candidates = [
        t for t in all_tensors(workload) if t[0] < last_short and t[2] >= _SMALLEST_TENSOR_BYTES
    ]
    members = list(group)
    if last_short < 0 or not candidates:
        return GroupSolution([[] for _ in members], 0.0, 0.0, "nothing to swap", 0)
    durations = list(workload.forward_s) + [workload.backward_s[j] for j in reversed(range(n))]
    slots = len(durations)
    backward_slot = {j: 2 * n - 1 - j for j in range(n)}

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", 1)
    inf = highspy.kHighsInf
    # Each slot is a stall (a wait before its compute starts) then its compute: phase 2s
    # lasts stall[s], phase 2s+1 lasts durations[s]. Copies flow in both phases.
    stall = [h.addVariable(lb=0.0, ub=inf) for _ in range(slots)]
    phases = 2 * slots
    x = [[h.addVariable(lb=0.0, ub=1.0, type=highspy.HighsVarType.kInteger) for _ in candidates]
         for _ in members]
    out = [[h.addVariable(lb=0.0, ub=inf) for _ in range(phases)] for _ in members]
    inn = [[h.addVariable(lb=0.0, ub=inf) for _ in range(phases)] for _ in members]
    sizes = [t[2] / GB for t in candidates]

    def swapped(m: int, layers: range) -> Any:
        return h.qsum(sizes[k] * x[m][k] for k, t in enumerate(candidates) if t[0] in layers)

    def window(phase: int) -> Any:
        return stall[phase // 2] if phase % 2 == 0 else durations[phase // 2]

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
            slot = phase // 2
            if slot < n:
                # Only tensors of layers before this forward slot can be on their way out.
                h.addConstr(cum_out - swapped(m, range(slot)) <= 0)
            # Nothing comes back before it has gone.
            h.addConstr(cum_in - outs_before[phase] <= 0)
        h.addConstr(cum_out - total == 0)
        h.addConstr(cum_in - total == 0)
        for i in range(n):
            run_f = 2 * i + 1
            run_b = 2 * backward_slot[i] + 1
            if needs[i] > 0:
                h.addConstr(outs_before[run_f] >= needs[i])
                h.addConstr(outs_before[run_b] - ins_before[run_b] >= needs[i])
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
    objective = h.qsum(stall) + tiny * h.qsum(
        sizes[k] * x[m][k] for m in range(len(members)) for k in range(len(candidates))
    )
    if warm is not None:
        chosen = [{(t[0], t[1]) for t in member} for member in warm]
        index = [x[m][k].index for m in range(len(members)) for k in range(len(candidates))]
        values = [
            1.0 if (t[0], t[1]) in chosen[m] else 0.0
            for m in range(len(members))
            for t in candidates
        ]
        h.setSolution(len(index), np.array(index, dtype=np.int32), np.array(values))
    h.minimize(objective)
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible solution found in time
        return GroupSolution([list(w) for w in warm] if warm else [[] for _ in members],
                             math.inf, math.inf, status, len(members) * len(candidates))
    solved = h.vals([v for row in x for v in row])
    choice: list[list[Tensor]] = []
    for m in range(len(members)):
        row = solved[m * len(candidates):(m + 1) * len(candidates)]
        choice.append([t for t, v in zip(candidates, row) if v > 0.5])
    stall_s = float(sum(h.vals(stall)))
    gap = float(info.mip_gap) if math.isfinite(info.mip_gap) else math.inf
    return GroupSolution(choice, stall_s, max(0.0, gap), status, len(members) * len(candidates))


def _fits(case: Case, tensors: Sequence[Tensor]) -> bool:
    latest = [Swap(t[0], t[1], t[2], t[0], t[0] + 1) for t in tensors]
    return case.workload.fits(latest, case.budget_bytes)


def plan_mip(case: Case, *, time_limit_s: float = 60.0) -> MipOutcome:
    """Solve the MIP per channel group, warm-started from the best heuristic plan.

    The MIP's plan is re-scored by the simulator; when it simulates slower than the warm
    start, the warm start is returned. Both estimates are in the notes. The outcome is
    remembered on ``case`` (``auto`` starts from it).
    """
    key = ("mip", time_limit_s)
    if key not in case.memo:
        case.memo[key] = _plan_mip(case, time_limit_s)
    return case.memo[key]


def _plan_mip(case: Case, time_limit_s: float) -> MipOutcome:
    from pipeswap.swap.channels import channel_groups

    started = time.perf_counter()
    heuristics = {
        name: case.score(HEURISTICS[name](case))
        for name in ("oblivious", "disjoint", "bidirectional")
    }
    warm_name = min(heuristics, key=lambda name: heuristics[name].iteration_s)
    warm = heuristics[warm_name]
    groups = channel_groups(case.topology, case.gpus)
    solved: dict[tuple[Any, ...], GroupSolution] = {}
    choice: dict[str, list[Tensor]] = {}
    stalls: list[float] = []
    gaps: list[float] = []
    statuses: list[str] = []
    sizes = {(t[0], t[1]): t for t in all_tensors(case.workload)}
    deadline = started + time_limit_s
    for group in groups:
        key = _group_key(case, group)
        if key not in solved:
            warm_sets = [
                [sizes[(s.layer, s.index)] for s in warm.assignment.swaps.get(g, ())]
                for g in group
            ]
            remaining = max(1.0, deadline - time.perf_counter())
            solved[key] = solve_group(case, group, warm_sets, time_limit_s=remaining)
            stalls.append(solved[key].stall_s)
            gaps.append(solved[key].mip_gap)
            statuses.append(solved[key].status)
        for gpu, tensors in zip(group, solved[key].choice):
            choice[gpu] = tensors
    candidates: dict[str, Scored] = {}
    if all(_fits(case, choice[g]) for g in case.gpus):
        swaps = {g: with_prefetch(case.workload, choice[g], case.budget_bytes) for g in case.gpus}
        candidates["mip"] = case.score(Assignment(swaps))
        if warm.assignment.offsets_s:
            candidates["mip+offsets"] = case.score(Assignment(swaps, warm.assignment.offsets_s))
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
