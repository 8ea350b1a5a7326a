"""Plans for every stage: max-min fair shares of a switch, coordinated or each on its own."""

from __future__ import annotations

import pytest
from layout_toys import GB, toy

from pipeswap.hardware.presets import preset
from pipeswap.layouts.mapping import mobius_mapping
from pipeswap.layouts.stage_plans import plan_stages, water_fill
from pipeswap.layouts.stage_swap import peak_bytes, stage_order, unit_memory
from pipeswap.layouts.stages import stage_costs
from pipeswap.pipeline.schedule import build_schedule


def test_water_fill_is_max_min_fair() -> None:
    assert water_fill(10.0, [1.0, 8.0, 8.0]) == pytest.approx([1.0, 4.5, 4.5])
    assert water_fill(10.0, [1.0, 2.0]) == pytest.approx([1.0, 2.0])
    assert water_fill(6.0, [0.0, 9.0, 9.0, 9.0]) == pytest.approx([0.0, 2.0, 2.0, 2.0])
    assert sum(water_fill(5.0, [3.0, 4.0])) == pytest.approx(5.0)


def _four_stages(coordinated: bool):
    """Four stages of 1f1b on switch-4 whose first stages must swap to fit 3 GB of
    activations: their costs, orders, budget and plans."""
    topology = preset("switch-4")
    schedule = build_schedule("1f1b", 4, 2, 4)
    costs = stage_costs(
        toy(8, saved_gb=4.0), (2, 2, 2, 2), schedule="1f1b", micro_batches=4, weights="stale"
    )
    orders = [stage_order(schedule, k) for k in range(4)]
    budget = costs[0].resident_bytes + 3 * GB
    planned = plan_stages(
        topology,
        topology.gpus,
        schedule,
        costs,
        orders,
        budget,
        replicas=1,
        coordinated=coordinated,
    )
    assert planned is not None
    return topology, costs, orders, budget, planned


@pytest.mark.parametrize("coordinated", [True, False])
def test_every_stage_fits_and_the_mapping_is_the_variants(coordinated: bool) -> None:
    topology, costs, orders, budget, (plans, placement) = _four_stages(coordinated)
    assert all(peak_bytes(o, c, p) <= budget for o, c, p in zip(orders, costs, plans))
    assert not plans[3].swapped and not plans[3].recomputed  # the last stage holds one unit
    if not coordinated:
        assert placement == mobius_mapping(topology, topology.gpus, 4, 1)
    assert sorted(g for row in placement for g in row) == sorted(topology.gpus)


def test_coordinated_stages_swap_no_more_than_their_switch_carries() -> None:
    _, costs, _, _, (shared, _) = _four_stages(True)
    _, _, _, _, (alone, _) = _four_stages(False)
    swapped = sum(unit_memory(c, p).swap for c, p in zip(costs, shared))
    assert swapped <= sum(unit_memory(c, p).swap for c, p in zip(costs, alone))


def test_a_budget_below_the_resident_state_has_no_plan() -> None:
    topology = preset("switch-4")
    schedule = build_schedule("1f1b", 4, 1, 4)
    costs = stage_costs(toy(8), (2, 2, 2, 2), schedule="1f1b", micro_batches=4, weights="stale")
    orders = [stage_order(schedule, k) for k in range(4)]
    assert (
        plan_stages(
            topology, topology.gpus, schedule, costs, orders, 1, replicas=1, coordinated=True
        )
        is None
    )
