"""Plans for every stage: max-min fair shares of a switch, coordinated or each on its own."""

from __future__ import annotations

import pytest
from layout_toys import GB, toy
from support import toy_layer, toy_profile_of

from pipeswap.hardware.presets import preset
from pipeswap.layouts.evaluate import score_pipeline
from pipeswap.schedule.timetable import build_schedule
from pipeswap.swap.plan.channels import channel_groups
from pipeswap.swap.plan.stage_costs import stage_costs
from pipeswap.swap.plan.stage_mapping import mobius_mapping
from pipeswap.swap.plan.stage_plans import plan_stages, water_fill
from pipeswap.swap.plan.stage_swap import peak_bytes, stage_order, unit_memory


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
    return topology, costs, orders, budget, _planned(schedule, costs, budget, 1, coordinated)


def _planned(schedule, costs, budget: int, replicas: int, coordinated: bool):
    """plan_stages on switch-4's GPUs, which must find plans."""
    topology = preset("switch-4")
    orders = [stage_order(schedule, k) for k in range(schedule.num_stages)]
    planned = plan_stages(
        topology,
        topology.gpus,
        schedule,
        costs,
        orders,
        budget,
        replicas=replicas,
        coordinated=coordinated,
    )
    assert planned is not None
    return planned


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


def test_replicas_of_a_swapping_stage_go_under_different_switches_and_run_faster() -> None:
    # GPipe, two stages, two replicas. The first stage's layers save 1 GB each (the
    # second's 0.1 GB), in passes of 10 ms forward and 20 ms backward: its four units do
    # not fit in 3.5 GB, and its copies keep a PCIe path busy, so a switch carries one
    # such stage, not two. Mobius's rule puts both replicas' first stages under one
    # switch; the cross mapping does not.
    profile = toy_profile_of(
        # Outputs as large as what a layer saves: recomputing one frees nothing.
        toy_layer(f"l{i}", 0.01, 0.02, param_bytes=GB // 100, output_bytes=size, saved=[size])
        for i, size in enumerate([GB] * 4 + [GB // 10] * 4)
    )
    topology = preset("switch-4")
    schedule = build_schedule("gpipe", 2, 8, 4)
    costs = stage_costs(profile, (4, 4), schedule="gpipe", micro_batches=4, weights="stale")
    budget = costs[0].resident_bytes + 7 * GB // 2
    rates = {}
    for coordinated in (True, False):
        plans, placement = _planned(schedule, costs, budget, 2, coordinated)
        assert plans[0].swapped and not plans[1].swapped
        first = {_switch(topology, row[0]) for row in placement}
        assert len(first) == (2 if coordinated else 1)
        scored = score_pipeline(
            profile, topology, budget, schedule, "stale", costs, (4, 4), placement, plans,
            mapping="cross", coordinated=coordinated, batch=1,
        )  # fmt: skip
        assert scored is not None
        rates[coordinated] = scored.layout.samples_per_s
    assert rates[True] > 1.2 * rates[False]


def _switch(topology, gpu: str) -> int:
    return next(i for i, g in enumerate(channel_groups(topology, topology.gpus)) if gpu in g)
