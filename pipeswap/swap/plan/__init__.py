"""Swap planning: the SwapPlan contract, the workload model, the policies and their bounds.

``from pipeswap.swap.plan import SwapPlan`` gives the contract; the planner is
:func:`pipeswap.swap.plan.planner.make_plan`.
"""

from pipeswap.swap.plan.contract import (
    READABLE_FORMATS,
    SWAPPLAN_FORMAT,
    GpuPlan,
    SwapDecision,
    SwapPlan,
    close_names,
    validate_plan,
)

__all__ = [
    "READABLE_FORMATS",
    "SWAPPLAN_FORMAT",
    "GpuPlan",
    "SwapDecision",
    "SwapPlan",
    "close_names",
    "validate_plan",
]
