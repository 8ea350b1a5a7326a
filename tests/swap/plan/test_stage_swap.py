"""A stage's memory over its own timeline, and the plans that keep it within a budget."""

from __future__ import annotations

import dataclasses

import pytest
from layout_toys import GB, toy

from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import build_schedule
from pipeswap.swap.plan.stage_costs import stage_costs
from pipeswap.swap.plan.stage_swap import (
    NO_PLAN,
    StagePlan,
    floor_bytes,
    memory_by_action,
    peak_bytes,
    plan_stage,
    prefetch_points,
    stage_order,
    unit_memory,
)


def _stage0(micro: int = 4):
    costs = stage_costs(toy(8), (2, 2, 2, 2), schedule="1f1b", micro_batches=micro, weights="stale")
    order = stage_order(build_schedule("1f1b", 4, 1, micro), 0)
    return order, costs[0]


def test_stage_0_of_1f1b_holds_one_unit_per_stage() -> None:
    order, c = _stage0()
    assert [kind for kind, _ in order][:5] == [ActionKind.F] * 4 + [ActionKind.B]
    # Four units of two layers at 1 GB / 4 micro-batches each, at the turn.
    assert peak_bytes(order, c, NO_PLAN) == c.resident_bytes + 4 * 2 * (GB // 4)


def test_swapping_everything_leaves_three_units_at_the_worst_moment() -> None:
    # F0 F1 F2 F3 B0 B1 B2 B3 UPDATE with prefetches two actions ahead: a unit's bytes are
    # on the GPU during its forward and the next action, and from its prefetch on; at F3
    # and at B0 three units overlap (worked out in the module's docstring rule).
    order, c = _stage0()
    plan = StagePlan(swapped=frozenset(c.layers), lead=2)
    assert unit_memory(c, plan).held == 0
    assert prefetch_points(order, 2) == {0: 2, 1: 3, 2: 4, 3: 5}
    units = [(m - c.resident_bytes) // (2 * (GB // 4)) for m in memory_by_action(order, c, plan)]
    assert units == [1, 2, 2, 3, 3, 2, 2, 1, 0]


def test_recomputing_a_layer_holds_only_its_input() -> None:
    order, c = _stage0()
    plan = StagePlan(recomputed=frozenset(c.layers))
    unit = unit_memory(c, plan)
    assert (unit.held, unit.swap) == (0, 0)  # the toy's outputs are empty
    assert unit.rerun == 2 * (GB // 4) and unit.recompute_s == pytest.approx(2 * 0.25)
    assert peak_bytes(order, c, plan) == c.resident_bytes + unit.rerun


def test_what_a_stage_measured_counts_where_it_is_held() -> None:
    order, c = _stage0()
    measured = dataclasses.replace(
        c,
        unit_extra_bytes=1,  # a unit's input and outputs, from its forward to its backward
        backward_transient_bytes=c.transient_bytes + 10,
        update_transient_bytes=100,
        pass_copy_bytes=1000,  # a stashing mode's live weights, kept aside in a backward
    )
    added = [
        m - p
        for m, p in zip(
            memory_by_action(order, measured, NO_PLAN), memory_by_action(order, c, NO_PLAN)
        )
    ]
    assert [kind for kind, _ in order] == [ActionKind.F] * 4 + [ActionKind.B] * 4 + [
        ActionKind.UPDATE
    ]
    assert added == [1, 2, 3, 4, 4 + 1010, 3 + 1010, 2 + 1010, 1 + 1010, 100]
    # A recomputed layer's forward computes all it would save: its unit holds it until the
    # layer ends, within the forward.
    plan = StagePlan(recomputed=frozenset(c.layers))
    forwards = memory_by_action(order, c, plan)[:4]
    assert forwards == [c.resident_bytes + c.transient_bytes + GB // 4] * 4  # kept: nothing


def test_plans_fit_their_budget_and_none_fits_below_the_floor() -> None:
    order, c = _stage0()
    floor = floor_bytes(order, c)
    for budget in (floor, floor + GB // 4, c.resident_bytes + 3 * GB // 2):
        plan = plan_stage(order, c, budget, allowance_bytes=GB, bytes_per_s=12e9)
        assert plan is not None and peak_bytes(order, c, plan) <= budget
    assert plan_stage(order, c, floor - 1, allowance_bytes=GB, bytes_per_s=12e9) is None
    assert plan_stage(order, c, 10 * GB, allowance_bytes=0, bytes_per_s=1.0) == NO_PLAN


def test_free_bandwidth_buys_swaps_and_a_slow_link_buys_recomputation() -> None:
    order, c = _stage0()
    budget = c.resident_bytes + 3 * GB // 2
    free = plan_stage(order, c, budget, allowance_bytes=10 * GB, bytes_per_s=12e9)
    slow = plan_stage(order, c, budget, allowance_bytes=0, bytes_per_s=1e6)
    assert free is not None and free.swapped and not free.recomputed
    assert slow is not None and slow.recomputed and not slow.swapped


def test_plans_use_only_the_moves_they_are_allowed() -> None:
    order, c = _stage0()
    budget = c.resident_bytes + 3 * GB // 2
    # A slow link would buy recomputation; without it, the plan swaps anyway.
    swaps = plan_stage(order, c, budget, allowance_bytes=0, bytes_per_s=1e6, recompute=False)
    assert swaps is not None and swaps.swapped and not swaps.recomputed
    recomputes = plan_stage(order, c, budget, allowance_bytes=10 * GB, bytes_per_s=12e9, swap=False)
    assert recomputes is not None and recomputes.recomputed and not recomputes.swapped
    # The floors: everything swapped, prefetched one action ahead (two units at the worst
    # moment: the one computing and the one copying), or everything recomputed.
    assert floor_bytes(order, c, recompute=False) == c.resident_bytes + 2 * 2 * (GB // 4)
    assert floor_bytes(order, c, swap=False) == floor_bytes(order, c)  # recompute frees all
    below = floor_bytes(order, c, recompute=False) - 1
    assert (
        plan_stage(order, c, below, allowance_bytes=GB, bytes_per_s=12e9, recompute=False) is None
    )
