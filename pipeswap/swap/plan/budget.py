"""A plan's budget: resolved from the settings, and where no plan fits it, the smallest that does.

A policy's floor (:meth:`Policy.least_budget`: what it can never swap or recompute) is a
bound no plan goes below, not a budget every policy reaches: a heuristic may need more
(hybrid's ladder of swaps and recomputations, an in-place model's working sets). So a
refusal names the smallest budget the policy was seen to plan, found by bisection between
the budget refused and the no-swap peak (a plan that swaps nothing fits there), each probe
one planning of the policy; the search stops at a thousandth of the peak or after
:data:`SEARCH_S`, and names the smallest budget that planned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pipeswap.config_fields import require
from pipeswap.hardware.topology import Topology
from pipeswap.swap.plan.policy_table import policy_entry
from pipeswap.swap.plan.refused import BudgetRefused, never_recomputed
from pipeswap.swap.plan.workload import Workload
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.units import format_bytes

__all__ = ["PROBE_S", "SEARCH_S", "naming_smallest", "resolve_budget", "smallest_planned"]

# The longest a refusal searches for the smallest budget its policy plans, and the most
# time a search (mip, auto) gets at each probe.
SEARCH_S = 5.0
PROBE_S = 1.0


def resolve_budget(
    workload: Workload, topology: Topology, gpus: Sequence[str], config: SwapConfig
) -> int:
    """The per-GPU budget in bytes; refuses budgets below what can never be swapped."""
    peak = workload.no_swap_peak_bytes()
    if config.footprint_ratio is not None:
        budget = int(peak / config.footprint_ratio)
    elif config.gpu_memory_bytes is not None:
        budget = config.gpu_memory_bytes
    else:
        budget = min(topology.node(g).memory_bytes for g in gpus)
        require(
            budget > 0,
            f"topology {topology.name!r} gives no GPU memory; pass {{gpu_memory_bytes}} or "
            "{footprint_ratio}",
        )
    policy = policy_entry(config.policy)
    if not policy.respects_budget:
        return budget  # a baseline plans by its rule; its peak is checked against the budget
    least = policy.least_budget(workload)
    if budget < least:
        held = never_recomputed(workload) if policy.recomputes else ""
        raise BudgetRefused(
            f"a budget of {budget} bytes ({format_bytes(budget)}) per GPU is below what "
            f"{workload.model} can never swap or recompute with policy {config.policy} "
            "(parameters, gradients, optimizer state, the working sets, the least one layer "
            f"holds{'; ' + held if held else ''})",
            floor=least - 1,
            peak=peak,
            smallest=least,
        )
    return budget


def smallest_planned(
    plans_at: Callable[[int], bool], low: int, high: int, *, seconds: float = SEARCH_S
) -> int | None:
    """The smallest budget in (``low``, ``high``] at which ``plans_at`` holds: ``low + 1``
    where it does, else by bisection (``low`` fails), to a thousandth of ``high`` or
    within ``seconds``; None where ``high`` fails too."""
    if not plans_at(high):
        return None
    if plans_at(low + 1):  # the floor itself (the policy's least budget) plans
        return low + 1
    deadline = time.perf_counter() + seconds
    while high - low > max(1, high // 1000) and time.perf_counter() < deadline:
        middle = (low + high) // 2
        if plans_at(middle):
            high = middle
        else:
            low = middle
    return high


def naming_smallest(refused: BudgetRefused, plans_at: Callable[[int], bool]) -> BudgetRefused:
    """``refused`` naming the smallest budget its policy was seen to plan."""
    smallest = smallest_planned(plans_at, refused.floor, refused.peak)
    return BudgetRefused(refused.reason, floor=refused.floor, peak=refused.peak, smallest=smallest)
