"""Contention-aware tensor swapping for data-parallel training: plans, policies, workloads."""

from pipeswap.swap.plan import SWAPPLAN_FORMAT, GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.planner import POLICIES, GpuSummary, PlanResult, make_plan

__all__ = [
    "POLICIES",
    "SWAPPLAN_FORMAT",
    "GpuPlan",
    "GpuSummary",
    "PlanResult",
    "SwapDecision",
    "SwapPlan",
    "make_plan",
]
