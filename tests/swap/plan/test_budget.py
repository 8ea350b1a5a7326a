"""pipeswap/swap/plan/budget.py: the smallest budget a policy plans, named by a refusal."""

from __future__ import annotations

import pytest

from pipeswap.swap.plan.budget import naming_smallest, smallest_planned
from pipeswap.swap.plan.refused import BudgetRefused


@pytest.mark.parametrize("threshold", [1001, 4567, 9000, 10_000])
def test_the_smallest_budget_is_found_by_bisection_to_a_thousandth(threshold: int) -> None:
    probes: list[int] = []

    def plans_at(budget: int) -> bool:
        probes.append(budget)
        return budget >= threshold

    found = smallest_planned(plans_at, 1000, 10_000)
    assert found is not None and threshold <= found <= threshold + 10
    assert len(probes) <= 2 + 14  # the peak, the floor, a bisection of 9000 to 10


def test_the_floor_itself_is_named_where_it_plans_and_none_where_nothing_does() -> None:
    assert smallest_planned(lambda budget: True, 999, 10_000) == 1000
    assert smallest_planned(lambda budget: False, 999, 10_000) is None


def test_a_refusal_names_what_it_found() -> None:
    refused = BudgetRefused("no plan fits", floor=1000, peak=10_000, smallest=None)
    named = naming_smallest(refused, lambda budget: budget >= 5000)
    assert "no plan fits; the smallest budget that works is 50" in str(named)
    assert "a footprint ratio of at most 1.99" in str(named)
    assert str(naming_smallest(refused, lambda budget: False)) == "no plan fits"
