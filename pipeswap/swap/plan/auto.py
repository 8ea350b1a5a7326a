"""The auto policy: the best of the other policies, refined by local search under the simulator."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.channels import channel_groups
from pipeswap.swap.plan.mip import plan_mip
from pipeswap.swap.plan.moves import (
    Moves,
    Offsets,
    Recomputes,
    State,
    Swaps,
    ordered,
)
from pipeswap.swap.plan.policies import HEURISTICS, late_members, with_best_offset
from pipeswap.swap.plan.scoring import Assignment, Scored, score

__all__ = ["local_search", "plan_auto"]

_PATIENCE = 120  # moves in a row that do not help before the search restarts
_STALE_RESTARTS = 8  # restarts in a row that do not beat the best before the search stops


def plan_auto(case: Case, *, time_limit_s: float) -> tuple[Scored, dict[str, Any]]:
    """The MIP's answer (itself the best of the MIP and every heuristic, as simulated),
    improved by local search for what is left of ``time_limit_s``.

    The search starts from two plans: that answer, and every GPU swapping what is best
    for one GPU alone with late GPUs offset (``_solo_start``). Each gets a quarter of
    the time left; the better then gets the rest. A plan is kept only when the whole
    case simulates faster, so the result is never slower than any other policy.
    """
    started = time.perf_counter()
    # Stop early enough for the final simulations of the whole case and the report.
    deadline = started + 0.85 * time_limit_s
    outcome = plan_mip(case, time_limit_s=time_limit_s)
    notes = dict(outcome.notes)
    notes["mip_gap"] = outcome.mip_gap
    best = outcome.scored
    starts = {"mip": best.assignment}
    if len(case.gpus) > 1 and deadline > time.perf_counter():
        solo = _solo_start(case, _share(deadline, 0.1))
        if solo is not None:
            starts["solo"] = solo
            notes["solo_simulated_s"] = case.score(solo).iteration_s
    found: dict[str, Assignment] = {}
    for name, assignment in starts.items():
        refined, stats = local_search(case, assignment, deadline=_share(deadline, 0.25))
        notes.update({f"{key} ({name})": value for key, value in stats.items()})
        found[name] = refined or assignment
    leader = min(found, key=lambda name: case.score(found[name]).iteration_s)
    refined, stats = local_search(case, found[leader], deadline=deadline, seed=1)
    notes.update({f"{key} ({leader}, again)": value for key, value in stats.items()})
    if refined is not None:
        found[leader] = refined
    for name, assignment in found.items():
        scored = case.score(assignment)
        if scored.iteration_s < best.iteration_s:
            best = scored
            notes["kept"] = (
                "one-GPU plan with offsets"
                if assignment is starts.get(name)
                else f"local search from {name}"
            )
    return best, notes


def _share(deadline: float, fraction: float) -> float:
    """The moment when ``fraction`` of the time left until ``deadline`` has passed."""
    now = time.perf_counter()
    return now + fraction * max(0.0, deadline - now)


def _solo_start(case: Case, deadline: float) -> Assignment | None:
    """Every GPU swaps the plan that is best for one GPU alone (one micro-batch, its own
    path; local search from ``oblivious``), and late GPUs start later, as bidirectional
    overlapping does; None when nothing must move."""
    solo = replace(case, gpus=case.gpus[:1], sync_every=1)
    start = HEURISTICS["oblivious"](solo)
    if not any(start.swaps.values()):
        return None
    refined, _ = local_search(solo, start, deadline=deadline)
    chosen = refined or start
    swaps = {gpu: chosen.swaps[case.gpus[0]] for gpu in case.gpus}
    layers = chosen.recomputed(case.gpus[0])
    recompute = {gpu: layers for gpu in case.gpus} if layers else {}
    late = late_members(case)
    return (
        with_best_offset(case, swaps, late, recompute)
        if late
        else Assignment(swaps, recompute=recompute)
    )


def local_search(
    case: Case, start: Assignment, *, deadline: float, seed: int = 0
) -> tuple[Assignment | None, dict[str, Any]]:
    """Iterated local search from ``start`` until ``deadline``.

    Layers ``start`` recomputes selectively stay so where they are recomputed (moves are
    weighed with them). Random moves (see ``_Moves``) are simulated one at a time; one
    that shortens the simulated iteration, with every GPU still within budget, is kept. After ``_PATIENCE``
    moves in a row that do not help, the best plan so far is kicked with a few random
    moves and the descent starts again; after ``_STALE_RESTARTS`` restarts in a row that
    do not beat the best, the search stops before the deadline. Candidates are ranked on
    one channel group when all groups have one shape (as ``bidirectional`` ranks its
    offsets); the result is the whole case's assignment, or None when nothing improved.
    """
    chosen = start.selective
    if chosen:  # its selectively recomputed layers stay so: every move is weighed with them
        case = replace(case, workload=case.workload.selecting(chosen))
    ranking = case.reduced()
    members = list(ranking.gpus)
    swaps: Swaps = {g: ordered(start.swaps.get(g, ())) for g in members}
    offsets: Offsets = {g: float(start.offsets_s.get(g, 0.0)) for g in members}
    recompute: Recomputes = {g: start.recomputed(g) for g in members}
    moves = Moves(case, members, random.Random(seed))
    seen: dict[Any, float] = {}

    def simulate_s(candidate: State) -> float:
        candidate_swaps, candidate_offsets, candidate_recompute = candidate
        key = (
            tuple(candidate_swaps[g] for g in members),
            tuple(round(candidate_offsets.get(g, 0.0), 9) for g in members),
            tuple(tuple(sorted(candidate_recompute[g])) for g in members),
        )
        if key not in seen:
            try:
                seen[key] = score(
                    case.workload,
                    ranking.topology,
                    members,
                    Assignment(
                        candidate_swaps,
                        {g: o for g, o in candidate_offsets.items() if o},
                        {g: r for g, r in candidate_recompute.items() if r},
                        chosen,
                    ),
                    sync_every=ranking.sync_every,
                    bucket_bytes=ranking.bucket_bytes,
                ).result.makespan_s
            except PipeswapError:  # an allocation that can never fit: not a plan
                seen[key] = math.inf
        return seen[key]

    initial_s = simulate_s((swaps, offsets, recompute))
    best = current = (swaps, offsets, recompute, initial_s)
    tried = restarts = stale = 0
    while time.perf_counter() < deadline and stale < _STALE_RESTARTS:
        failures = 0
        while failures < _PATIENCE and time.perf_counter() < deadline:
            candidate = moves.sample(current[0], current[1], current[2])
            if candidate is None:
                failures += 1
                continue
            tried += 1
            seconds = simulate_s(candidate)
            if seconds < current[3] - 1e-12:
                current = (*candidate, seconds)
                failures = 0
            else:
                failures += 1
        if current[3] < best[3] - 1e-12:
            best, stale = current, 0
        else:
            stale += 1
        # Kick the best plan with a few random moves that fit, whatever they cost.
        restarts += 1
        kicked: State = (best[0], best[1], best[2])
        for _ in range(3):
            kicked = moves.sample(*kicked) or kicked
        current = (*kicked, simulate_s(kicked))
    stats = {
        "search_moves_tried": tried,
        "search_restarts": restarts,
        "search_ranked_s": best[3],
        "search_start_ranked_s": initial_s,
    }
    if best[3] >= initial_s:
        return None, stats
    return replace(_expand(case, members, best[0], best[1], best[2]), selective=chosen), stats


def _expand(
    case: Case, members: Sequence[str], swaps: Swaps, offsets: Offsets, recompute: Recomputes
) -> Assignment:
    """The whole case's assignment from the ranking group's: position p of every channel
    group gets what member p got (the groups have one shape), its recomputed layers too."""
    if list(members) == list(case.gpus):
        return Assignment(
            dict(swaps),
            {g: o for g, o in offsets.items() if o},
            {g: r for g, r in recompute.items() if r},
        )
    full_swaps: Swaps = {}
    full_offsets: Offsets = {}
    full_recompute: dict[str, frozenset[int]] = {}
    for group in channel_groups(case.topology, case.gpus):
        for position, gpu in enumerate(group):
            full_swaps[gpu] = swaps[members[position]]
            if offsets.get(members[position]):
                full_offsets[gpu] = offsets[members[position]]
            if recompute.get(members[position]):
                full_recompute[gpu] = recompute[members[position]]
    return Assignment(full_swaps, full_offsets, full_recompute)
