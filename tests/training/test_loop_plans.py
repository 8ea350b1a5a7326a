"""pipeswap/training/loop_plans.py: a shape's plan measured, and made again for less."""

from __future__ import annotations

from typing import Any

from pipeswap.training.loop_plans import REPLANS, LoopPlanner, ShapePlan


def _planned(budget: int) -> ShapePlan:
    placeholder: Any = None
    return ShapePlan(None, placeholder, placeholder, budget, 0.0)


def test_a_step_over_its_budget_makes_the_next_plan_tighter_at_most_twice() -> None:
    planner: Any = LoopPlanner.__new__(LoopPlanner)  # measured() reads no planner state
    planned = _planned(1000)
    LoopPlanner.measured(planner, planned, 900)
    assert (planned.measured_peak_bytes, planned.replan_due, planned.margin_bytes) == (
        900,
        False,
        0,
    )
    LoopPlanner.measured(planner, planned, 1100)
    assert planned.replan_due and planned.margin_bytes == 100
    planned.replan_due, planned.replans = False, REPLANS
    LoopPlanner.measured(planner, planned, 1200)
    assert not planned.replan_due and planned.margin_bytes == 100  # no third plan
