"""What ``Offload.stats()`` says of the plan a step ran: its policy, its predictions beside
the meter's reading, and how it was made."""

from __future__ import annotations

from typing import Any

from pipeswap.dist.group import rank_and_world
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.training.shape_plan import ShapePlan

__all__ = ["NO_CALL", "no_plan_stats", "plan_stats"]

# What stats() says of the step that ran, before any has.
NO_CALL: dict[str, Any] = {
    "shape": None,
    "planned_shape": None,
    "step_planning_s": 0.0,
    "learning": None,
}


def no_plan_stats(policy: str) -> dict[str, Any]:
    """The plan's part of stats() before any plan has run: the same keys, so that a loop
    logging them needs no case of its own; ``policy`` is the one asked for."""
    return {
        "policy": policy,
        "predicted_step_s": None,
        "predicted_stall_s": None,
        "recomputes_all": None,
        "planned_for_bytes": None,
        "predicted_peak_bytes": None,
        "measured_peak_bytes": None,
        "no_swap_peak_bytes": None,
        "smallest_budget_bytes": None,
        "memory_meter": None,
        "planning_s": None,
        "replans": None,
        "derived_from": None,
    }


def plan_stats(planned: ShapePlan, measured_peak_bytes: int | None) -> dict[str, Any]:
    """The plan's part of stats(): ``measured_peak_bytes`` is the meter's peak over the
    plan's first step (while that runs, the most so far; None: not measured)."""
    result = planned.result
    rank, _ = rank_and_world()
    workload = workload_from_profile(planned.profile)
    return {
        "policy": result.policy,
        "predicted_step_s": result.iteration_s,
        "predicted_stall_s": max(0.0, result.iteration_s - result.compute_s),
        "recomputes_all": planned.recomputes_all,
        "planned_for_bytes": result.budget_bytes,
        "predicted_peak_bytes": result.gpus[rank].peak_bytes,
        "measured_peak_bytes": measured_peak_bytes,
        "no_swap_peak_bytes": workload.no_swap_peak_bytes(),
        "smallest_budget_bytes": workload.min_budget_bytes(),
        "memory_meter": getattr(planned.profile.memory, "meter", None),
        "planning_s": planned.planning_s,
        "replans": planned.replans,
        "derived_from": planned.derived_from,
    }
