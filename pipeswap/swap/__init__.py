"""Contention-aware tensor swapping for data-parallel training: plans, policies, the executor.

The package imports nothing when it is imported: ``pipeswap.swap.config`` is read by
every config, so reading it must not load the planner or torch. The public names below
are loaded on first use (``pipeswap.swap.make_plan``, ``from pipeswap.swap import
SwapExecutor``); the mechanisms live in ``pipeswap.swap.plan`` (planning) and
``pipeswap.swap.runtime`` (applying a plan to a model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "POLICY_NAMES": "pipeswap.swap.config",
    "SwapConfig": "pipeswap.swap.config",
    "SWAPPLAN_FORMAT": "pipeswap.swap.plan.contract",
    "GpuPlan": "pipeswap.swap.plan.contract",
    "SwapDecision": "pipeswap.swap.plan.contract",
    "SwapPlan": "pipeswap.swap.plan.contract",
    "POLICIES": "pipeswap.swap.plan.policy_table",
    "GpuSummary": "pipeswap.swap.plan.planner",
    "PlanResult": "pipeswap.swap.plan.planner",
    "make_case": "pipeswap.swap.plan.planner",
    "make_plan": "pipeswap.swap.plan.planner",
    "plan_case": "pipeswap.swap.plan.planner",
    "StepStats": "pipeswap.swap.runtime.stats",
    "SwapExecutor": "pipeswap.swap.runtime.executor",
}

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
    from pipeswap.swap.config import POLICY_NAMES, SwapConfig
    from pipeswap.swap.plan.contract import SWAPPLAN_FORMAT, GpuPlan, SwapDecision, SwapPlan
    from pipeswap.swap.plan.planner import GpuSummary, PlanResult, make_case, make_plan, plan_case
    from pipeswap.swap.plan.policy_table import POLICIES
    from pipeswap.swap.runtime.executor import SwapExecutor
    from pipeswap.swap.runtime.stats import StepStats


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeswap.swap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
