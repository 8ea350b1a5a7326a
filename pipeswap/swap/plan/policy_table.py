"""Every swap policy's algorithm, one entry each: how it plans, and whether it keeps to the budget.

A policy is declared in pipeswap.swap.swap_config.POLICY_KINDS (its name, what a pipeline's
stages do under it); its entry here is how it plans. :func:`policy_entry` finds it, and
names the missing piece when a declared policy has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeswap.config_fields import ConfigError
from pipeswap.swap.plan.auto import plan_auto
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.finer import plan_finer
from pipeswap.swap.plan.hybrid import hybrid
from pipeswap.swap.plan.mip import plan_mip
from pipeswap.swap.plan.policies import HEURISTICS, heuristic
from pipeswap.swap.plan.scoring import Assignment, Scored
from pipeswap.swap.plan.workload import Workload
from pipeswap.swap.swap_config import policy_kind

__all__ = ["POLICIES", "Planned", "Planner", "Policy", "policy_entry"]


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
    # The least budget its plans can hold, where it is not the workload's bound for plans
    # that swap (and recompute, where ``recomputes``).
    smallest: Callable[[Workload], int] | None = None

    def least_budget(self, workload: Workload) -> int:
        """The smallest budget this policy's plans can hold on ``workload``."""
        if self.smallest is not None:
            return self.smallest(workload)
        return workload.min_budget_bytes(recomputing=self.recomputes)


def _rule(
    name: str,
    assign: Callable[[Case], Assignment],
    peak: str = "",
    recomputes: bool = False,
    smallest: Callable[[Workload], int] | None = None,
) -> Policy:
    def plan(case: Case, time_limit_s: float) -> Planned:
        return Planned(case.score(assign(case)), {})

    return Policy(
        name,
        plan,
        respects_budget=not peak,
        peak=peak,
        assign=assign,
        recomputes=recomputes,
        smallest=smallest,
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


def _finer(case: Case) -> Assignment:
    """The finer recompute-only plan; where none fits, every block recomputed whole (which
    does not fit either: the planner's simulation says by how much)."""
    return plan_finer(case) or heuristic(case, "recompute")


def _all_recomputed(workload: Workload) -> int:
    """What every block recomputed whole holds, nothing swapped: the least a plan of
    recomputation alone reaches."""
    return workload.recomputing(workload.recomputable).no_swap_peak_bytes()


def _remembered(name: str) -> Callable[[Case], Assignment]:
    return lambda case: heuristic(case, name)


POLICIES: dict[str, Policy] = {
    **{
        name: _rule(
            name,
            _remembered(name),
            _PEAKS.get(name, ""),
            recomputes=name == "recompute",
            smallest=_all_recomputed if name == "recompute" else None,
        )
        for name in HEURISTICS
    },
    "finer": Policy(
        "finer",
        lambda case, _: Planned(case.score(_finer(case)), {}),
        assign=_finer,
        recomputes=True,
        smallest=_all_recomputed,
    ),
    "hybrid": _rule("hybrid", hybrid, recomputes=True),
    "mip": Policy("mip", _mip, recomputes=True),
    "auto": Policy("auto", _auto, recomputes=True),
}


def policy_entry(name: str) -> Policy:
    """The algorithm of the swap policy ``name``: a ConfigError naming the valid policies for
    a name in no entry of pipeswap.swap.swap_config.POLICY_KINDS, or the missing entry here."""
    entry = POLICIES.get(policy_kind(name).name)
    if entry is None:
        raise ConfigError(
            f"swap policy {name!r} is declared (pipeswap.swap.swap_config.POLICY_KINDS) but has no "
            "algorithm: add its entry to POLICIES in pipeswap.swap.plan.policy_table"
        )
    return entry
