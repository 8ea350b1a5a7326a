"""Every swap policy, one entry each: how it plans, and whether it keeps to the budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeswap.swap.config import POLICY_NAMES
from pipeswap.swap.plan.auto import plan_auto
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.hybrid import hybrid
from pipeswap.swap.plan.mip import plan_mip
from pipeswap.swap.plan.policies import HEURISTICS, heuristic
from pipeswap.swap.plan.scoring import Assignment, Scored


class Planned(NamedTuple):
    """What a policy gives the planner: its scored plan, its notes (they go into the plan)
    and, for the MIP and auto, the solver's gap (None for the rules)."""

    scored: Scored
    notes: dict[str, Any]
    mip_gap: float | None = None


Planner = Callable[[Case, float], Planned]


@dataclass(frozen=True)
class Policy:
    """One policy. ``plan(case, time_limit_s)`` gives its scored plan, notes and gap.

    ``respects_budget`` is False for the baselines that plan without looking at the
    budget (they may not fit it; the planner then scores them without a memory limit and
    says so, naming ``peak``: what their peak is).
    """

    name: str
    plan: Planner
    respects_budget: bool = True
    peak: str = ""
    assign: Callable[[Case], Assignment] | None = None  # rule-based: the plan before scoring
    recomputes: bool = False  # may recompute layers (the smallest budget it reaches is lower)


def _rule(
    name: str, assign: Callable[[Case], Assignment], peak: str = "", recomputes: bool = False
) -> Policy:
    def plan(case: Case, time_limit_s: float) -> Planned:
        return Planned(case.score(assign(case)), {})

    return Policy(
        name, plan, respects_budget=not peak, peak=peak, assign=assign, recomputes=recomputes
    )


def _mip(case: Case, time_limit_s: float) -> Planned:
    outcome = plan_mip(case, time_limit_s=time_limit_s)
    return Planned(outcome.scored, dict(outcome.notes), outcome.mip_gap)


def _auto(case: Case, time_limit_s: float) -> Planned:
    scored, notes = plan_auto(case, time_limit_s=time_limit_s)
    return Planned(scored, notes, notes.get("mip_gap"))  # auto's notes carry the MIP's gap


_PEAKS = {
    "none": "the no-swap peak",
    "recompute": "the peak with every block recomputed",
    "save-on-cpu": "the peak with every saved tensor on host",
}


def _remembered(name: str) -> Callable[[Case], Assignment]:
    return lambda case: heuristic(case, name)


POLICIES: dict[str, Policy] = {
    **{
        name: _rule(name, _remembered(name), _PEAKS.get(name, ""), name == "recompute")
        for name in HEURISTICS
    },
    "hybrid": _rule("hybrid", hybrid, recomputes=True),
    "mip": Policy("mip", _mip, recomputes=True),
    "auto": Policy("auto", _auto, recomputes=True),
}
assert tuple(POLICIES) == POLICY_NAMES, "SwapConfig offers exactly the policies of this table"
