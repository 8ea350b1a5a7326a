"""Every swap policy, one entry each: how it plans, and whether it keeps to the budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeswap.swap.config import POLICY_NAMES
from pipeswap.swap.plan.auto import plan_auto
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.hybrid import hybrid
from pipeswap.swap.plan.mip import plan_mip
from pipeswap.swap.plan.policies import HEURISTICS, heuristic
from pipeswap.swap.plan.scoring import Assignment, Scored

Planner = Callable[[Case, float], tuple[Scored, dict[str, Any]]]


@dataclass(frozen=True)
class Policy:
    """One policy. ``plan(case, time_limit_s)`` gives its scored plan and notes.

    ``respects_budget`` is False for the baselines that plan without looking at the
    budget (they may not fit it; the planner then scores them without a memory limit and
    says so, naming ``peak``: what their peak is).
    """

    name: str
    plan: Planner
    respects_budget: bool = True
    peak: str = ""
    assign: Callable[[Case], Assignment] | None = None  # rule-based: the plan before scoring


def _rule(name: str, assign: Callable[[Case], Assignment], peak: str = "") -> Policy:
    def plan(case: Case, time_limit_s: float) -> tuple[Scored, dict[str, Any]]:
        return case.score(assign(case)), {}

    return Policy(name, plan, respects_budget=not peak, peak=peak, assign=assign)


def _mip(case: Case, time_limit_s: float) -> tuple[Scored, dict[str, Any]]:
    outcome = plan_mip(case, time_limit_s=time_limit_s)
    return outcome.scored, {**outcome.notes, "mip_gap": outcome.mip_gap}


def _auto(case: Case, time_limit_s: float) -> tuple[Scored, dict[str, Any]]:
    return plan_auto(case, time_limit_s=time_limit_s)


_PEAKS = {
    "none": "the no-swap peak",
    "recompute": "the peak with every block recomputed",
    "save-on-cpu": "the peak with every saved tensor on host",
}


def _remembered(name: str) -> Callable[[Case], Assignment]:
    return lambda case: heuristic(case, name)


POLICIES: dict[str, Policy] = {
    **{name: _rule(name, _remembered(name), _PEAKS.get(name, "")) for name in HEURISTICS},
    "hybrid": _rule("hybrid", hybrid),
    "mip": Policy("mip", _mip),
    "auto": Policy("auto", _auto),
}
assert tuple(POLICIES) == POLICY_NAMES, "SwapConfig offers exactly the policies of this table"
