"""pipeswap/training/loop_plans.py: a shape's plan measured, and made again for less."""

from __future__ import annotations

from typing import Any

import torch

from pipeswap.config_fields import ConfigError
from pipeswap.training.loop_plans import REPLANS, LoopPlanner, ShapePlan


def _planned(budget: int) -> ShapePlan:
    placeholder: Any = None
    return ShapePlan(None, placeholder, placeholder, budget, 0.0)


def test_a_step_over_its_budget_makes_the_next_plan_tighter_at_most_twice() -> None:
    planner: Any = LoopPlanner.__new__(LoopPlanner)  # measured() reads only overshoot
    planner.overshoot = 0.0
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
    assert planner.overshoot == 0.2  # the most any step held over, as a fraction


def test_later_plans_start_tighter_by_what_measured_steps_held_over() -> None:
    """The meter's excess on one plan carries to every later one: made that much tighter
    from the start, or for the budget itself where the tighter one cannot fit."""
    planner: Any = LoopPlanner.__new__(LoopPlanner)
    planner.overshoot, planner.budget_bytes = 0.0, 1000
    planner.device = torch.device("cpu")
    LoopPlanner.measured(planner, _planned(1000), 1100)
    asked: list[int] = []
    least = 0

    def make(profile: Any, budget: int, *call: Any, config: Any = None) -> tuple[str, None]:
        asked.append(budget)
        if budget < least:
            raise ConfigError("no plan fits")
        return "plan", None

    planner.make = make
    placeholder: Any = None
    settle = LoopPlanner.settle
    planned = settle(planner, placeholder, ((), {}), 0.0, shape="4x8", fits="4x8", check=False)
    assert asked == [900] and planned.margin_bytes == 100 and planned.budget_bytes == 1000
    asked.clear()
    least = 950
    planned = settle(planner, placeholder, ((), {}), 0.0, shape="4x8", fits="4x8", check=False)
    assert asked == [900, 1000] and planned.margin_bytes == 0
