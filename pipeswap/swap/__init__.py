"""Contention-aware tensor swapping for data-parallel training: plans, policies, the executor.

The package imports nothing when it is imported: ``pipeswap.swap.swap_config`` is read by
every config, so reading it must not load the planner or torch. The public names below
are loaded on first use (``pipeswap.swap.make_plan``, ``from pipeswap.swap import
SwapExecutor``); the mechanisms live in ``pipeswap.swap.plan`` (planning) and
``pipeswap.swap.runtime`` (applying a plan to a model).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = [
    "GpuPlan",
    "GpuSummary",
    "POLICIES",
    "POLICY_NAMES",
    "PlanResult",
    "SWAPPLAN_FORMAT",
    "StepStats",
    "SwapConfig",
    "SwapDecision",
    "SwapExecutor",
    "SwapPlan",
    "make_case",
    "make_plan",
    "plan_case",
]

if TYPE_CHECKING:
    from pipeswap.swap.plan.contract import SWAPPLAN_FORMAT, GpuPlan, SwapDecision, SwapPlan
    from pipeswap.swap.plan.planner import GpuSummary, PlanResult, make_case, make_plan, plan_case
    from pipeswap.swap.plan.policy_table import POLICIES
    from pipeswap.swap.runtime.executor import SwapExecutor
    from pipeswap.swap.runtime.stats import StepStats
    from pipeswap.swap.swap_config import POLICY_NAMES, SwapConfig


def _modules() -> tuple[ModuleType, ...]:
    """The modules the public names come from, loaded on the first use of one of them."""
    from pipeswap.swap import swap_config
    from pipeswap.swap.plan import contract, planner, policy_table
    from pipeswap.swap.runtime import executor, stats

    return swap_config, contract, policy_table, planner, stats, executor


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pipeswap.swap' has no attribute {name!r}")
    value = next(vars(m)[name] for m in _modules() if name in vars(m))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
