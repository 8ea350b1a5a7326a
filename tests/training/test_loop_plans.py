"""pipeswap/training/loop_plans.py: a shape's plan measured, and made again for less."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.training.loop_plans import LoopPlanner
from pipeswap.training.shape_plan import REPLANS, ShapePlan
from tests.support import toy_layer, toy_profile_of


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


def test_a_plan_made_again_that_held_more_than_the_one_before_is_dropped_for_it() -> None:
    """The meter, not the memory model, decides: a plan made again for less whose step held
    more than the step of the plan before it is dropped, that one kept, with a warning."""
    planner: Any = LoopPlanner.__new__(LoopPlanner)
    planner.overshoot, planner.config = 0.0, None

    class Executor:
        closed = False

        def close(self) -> None:
            self.closed = True

    first, second = Executor(), Executor()
    planner.make = lambda *args, **kwargs: ("second plan", second)
    placeholder: Any = None
    planned = ShapePlan(first, placeholder, placeholder, 1000, 0.0)  # type: ignore[arg-type]
    LoopPlanner.measured(planner, planned, 1100)
    with pytest.warns(RuntimeWarning, match="planned again"):
        planned = LoopPlanner.replan(planner, planned, (), {})
    assert planned.executor is second and not first.closed  # kept until second is read
    with pytest.warns(
        RuntimeWarning, match=r"held 1.22 KiB, no less than the one before it \(1.07 KiB\)"
    ):
        LoopPlanner.measured(planner, planned, 1250)
    assert planned.executor is first and second.closed
    assert (planned.measured_peak_bytes, planned.replan_due) == (1100, False)  # no third try


def test_a_shape_refused_though_its_bound_is_within_the_budget_says_what_the_plans_needed() -> None:
    """The bound (what can never move) was put as "needs at least X ... more than the
    budget" even where X was below it (BART's padded batches under policy recompute: the
    rule's plan needed more): such a refusal now gives the plans' own reason."""
    planner: Any = LoopPlanner.__new__(LoopPlanner)  # _beyond_budget reads on_infeasible
    planner.on_infeasible, planner.config = "error", SwapConfig()
    profile = toy_profile_of(
        [toy_layer("a", 1e-3, 2e-3, saved=[100]), toy_layer("b", 1e-3, 2e-3, saved=[100])]
    )
    why = "policy recompute plans by its rule, and its plan needs 5000 bytes"
    with pytest.raises(
        ConfigError,
        match=r"no plan keeps a batch of shape 4x8 within the run's budget of .* \(1000000 bytes\) \(policy recompute plans by its rule.*give offload\(gpu_memory=\.\.\.\) more",
    ) as refused:
        LoopPlanner._beyond_budget(planner, profile, 1_000_000, ((), {}), "4x8", "4x4", why)
    assert "needs at least" not in str(refused.value)
    with pytest.raises(
        ConfigError,
        match=r"4x8 needs at least 100 B \(100 bytes\) .* more than the run's budget of 50 B",
    ):
        LoopPlanner._beyond_budget(planner, profile, 50, ((), {}), "4x8", "4x4", why)
