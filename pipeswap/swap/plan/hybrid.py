"""The hybrid policy: per layer, recompute where the link is the bottleneck, swap the rest."""

from __future__ import annotations

from dataclasses import replace

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.finer import plan_finer
from pipeswap.swap.plan.policies import (
    SWAP_ONLY,
    fits,
    heuristic,
    plan_bidirectional,
    plan_disjoint,
)
from pipeswap.swap.plan.scoring import Assignment
from pipeswap.swap.plan.workload import Workload
from pipeswap.units import format_bytes

__all__ = ["ORDERS", "hybrid", "plan_hybrid", "recompute_ladder", "recompute_order"]

# Rungs of the ladder: recompute until the freed bytes reach these fractions of the
# deficit (the rest is swapped), and the first set that fits with nothing swapped.
_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_FINALISTS = 2  # rungs whose disjoint plans get a whole-case simulation
_BIDIRECTIONAL_TRIES = 4  # rungs that get bidirectional offsets, walking from the best


ORDERS = ("cheapest", "latest")


def recompute_order(workload: Workload, budget_bytes: int, order: str = "cheapest") -> list[int]:
    """Layers worth recomputing, in the order a ladder takes them.

    ``cheapest``: forward seconds per byte freed, ties to the later layer; ``latest``:
    the later layer first (Capuchin's rule: swap what the distance to its backward can
    hide, recompute what it cannot; early layers' swaps hide best). A layer helps only if
    recomputing it frees forward memory (its saved bytes exceed the input it keeps) and
    it comes before the last layer short of memory (whose backward holds the re-run's
    tensors as its forward held them).
    """
    needs = workload.needs(budget_bytes)
    last_short = max((i for i, need in enumerate(needs) if need > 0), default=-1)
    freed = workload.freed_bytes
    # The last short layer's own backward holds its re-run's tensors: no help there,
    # unless its point is its forward (the turn after the last layer: head and loss).
    helpful = [i for i in range(last_short) if freed[i] > 0]
    if last_short >= 0 and freed[last_short] > 0 and _own_point_drops(workload, last_short):
        helpful.append(last_short)
    if order == "latest":
        return sorted(helpful, reverse=True)
    return sorted(helpful, key=lambda i: (workload.forward_s[i] / freed[i], -i))


def _own_point_drops(workload: Workload, layer: int) -> bool:
    """Whether recomputing ``layer`` lowers the memory at its own point."""
    alone = workload.recomputing(workload.recompute | {layer})
    before = workload.saved_bytes[layer] + workload.working_bytes[layer]
    return alone.saved_bytes[layer] + alone.working_bytes[layer] < before


def recompute_ladder(
    workload: Workload, budget_bytes: int, order: str = "cheapest"
) -> list[frozenset[int]]:
    """Nested recompute sets along :func:`recompute_order`: the first prefix whose freed
    bytes reach each fraction of the deficit, and the first prefix that fits with nothing
    swapped (the cheapest recompute-only plan along that order), if any."""
    needs = workload.needs(budget_bytes)
    deficit = max(needs, default=0)
    if deficit <= 0:
        return []
    rungs: list[frozenset[int]] = []
    targets = [f * deficit for f in _FRACTIONS]
    freed = 0
    layers = recompute_order(workload, budget_bytes, order)
    for k, layer in enumerate(layers):
        freed += workload.freed_bytes[layer]
        chosen = frozenset(layers[: k + 1])
        reached = False
        while targets and freed >= targets[0]:
            targets.pop(0)
            reached = True
        if not any(workload.recomputing(chosen).needs(budget_bytes)):
            rungs.append(chosen)  # fits on recomputation alone: more cannot help
            break
        if reached:
            rungs.append(chosen)
    return rungs


def hybrid(case: Case) -> Assignment:
    """:func:`plan_hybrid` on ``case``, made once per case."""
    return case.remembered(("heuristic", "hybrid"), lambda: plan_hybrid(case))


def plan_hybrid(case: Case) -> Assignment:
    """Swap or recompute, per layer, whichever frees memory more cheaply.

    Swapping a byte costs link time, which is free while the link has slack and is the
    whole cost where the link is the bottleneck; recomputing costs the layer's forward
    again, whatever the link does. Every GPU recomputes one set of layers, taken along
    two :func:`recompute_ladder` (cheapest forward per byte freed first, and latest layer
    first; each up to the whole deficit); for each rung the GPUs swap what is left as
    ``disjoint`` does, ranked by simulating one channel group over at most two
    micro-batches. From the best rung, ``bidirectional``'s offsets are tried on the rungs
    below it on its ladder (fewer recomputed layers) while they help (or one rung above
    when the first step down does not). The answer is the fastest on the whole case among
    them, the cheapest recompute-only plan of each ladder, the recompute-only plan of
    finer choices (:func:`~pipeswap.swap.plan.finer.plan_finer`), the swap-only
    heuristics, ``recompute`` and ``save-on-cpu`` (where they fit): never slower than any
    of those.
    """
    candidates: dict[str, Assignment] = {}
    for name in (*SWAP_ONLY, "recompute", "save-on-cpu"):
        try:
            assignment = heuristic(case, name)
        except PipeswapError:  # a layer it must keep holds more than the budget alone
            continue
        if fits(case, assignment):
            candidates[name] = assignment
    finer = plan_finer(case)  # recomputation finer than a block, where it was measured
    if finer is not None:
        candidates["recompute (finer)"] = finer
    ladders = [recompute_ladder(case.workload, case.budget_bytes, order) for order in ORDERS]
    # One list of rungs; a set both ladders reach is tried once.
    ladder = list(dict.fromkeys(rung for steps in ladders for rung in steps))
    if ladder:
        ranking = replace(case.reduced(), sync_every=min(case.sync_every, 2))
        ranked: list[tuple[float, int, Assignment]] = []
        for rung, layers in enumerate(ladder):
            try:
                assignment = plan_disjoint(case, layers)
            except PipeswapError:  # what these layers keep leaves too little to swap
                continue
            if fits(case, assignment):
                ranked.append((ranking.score(assignment).iteration_s, rung, assignment))
        ranked.sort(key=lambda item: (item[0], item[1]))
        for steps in ladders:
            # The cheapest recompute-only plan of each ladder, when one fits.
            if steps and not any(case.workload.recomputing(steps[-1]).needs(case.budget_bytes)):
                candidates[f"recompute{sorted(steps[-1])}"] = Assignment(
                    {gpu: () for gpu in case.gpus}, recompute={gpu: steps[-1] for gpu in case.gpus}
                )
        for _, rung, assignment in ranked[:_FINALISTS]:
            candidates[f"disjoint+recompute{sorted(ladder[rung])}"] = assignment
        if ranked:
            # Offsets let the channel carry more, so bidirectional's best rung recomputes
            # no more than disjoint's: walk down its ladder from there while it helps.
            first = ladder[ranked[0][1]]
            steps = next(steps for steps in ladders if first in steps)
            tried: dict[int, float] = {}
            rung = steps.index(first)
            step = -1
            while 0 <= rung < len(steps) and len(tried) < _BIDIRECTIONAL_TRIES:
                try:
                    offset = plan_bidirectional(case, steps[rung])
                except PipeswapError:  # pragma: no cover - disjoint fitted with these layers
                    break
                if not fits(case, offset):
                    break
                candidates[f"bidirectional+recompute{sorted(steps[rung])}"] = offset
                tried[rung] = case.score(offset).iteration_s
                better = min(tried.values()) == tried[rung]
                if not better and step < 0 and rung + 2 < len(steps) and len(tried) == 2:
                    rung, step = rung + 2, 1  # the first step down lost: try one up
                    continue
                if not better:
                    break
                rung += step
    if not candidates:
        raise PipeswapError(
            f"no plan of swaps and recomputation fits a budget of {case.budget_bytes} bytes "
            f"({format_bytes(case.budget_bytes)}); give a larger budget"
        )
    best = min(candidates, key=lambda name: (case.score(candidates[name]).iteration_s, name))
    return candidates[best]
