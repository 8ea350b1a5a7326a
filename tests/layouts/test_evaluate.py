"""Scoring a layout: the steady-state step, what its layout records, and no score when it
runs out of memory."""

from __future__ import annotations

import pytest
from layout_toys import GB, toy

from pipeswap.hardware.presets import preset
from pipeswap.layouts.evaluate import score_data_parallel, score_pipeline, steady_rate_s
from pipeswap.layouts.graphs import layout_graph
from pipeswap.layouts.layout import DATA_PARALLEL, PIPELINE
from pipeswap.schedule.timetable import build_schedule
from pipeswap.sim.engine import simulate
from pipeswap.swap.plan.planner import make_plan
from pipeswap.swap.plan.stage_costs import stage_costs
from pipeswap.swap.plan.stage_swap import NO_PLAN


def _gpipe(steps: int):
    profile = toy(4)
    schedule = build_schedule("gpipe", 2, steps, 2)
    costs = stage_costs(profile, (2, 2), schedule="gpipe", micro_batches=2, weights="stale")
    return profile, schedule, costs


def test_a_flushed_step_repeats_so_the_steady_step_is_one_steps_makespan() -> None:
    topology = preset("switch-4")
    _, one, costs = _gpipe(1)
    alone = simulate(layout_graph(one, costs, [("gpu0", "gpu1")]), topology).makespan_s
    _, eight, _ = _gpipe(8)
    result = simulate(layout_graph(eight, costs, [("gpu0", "gpu1")]), topology)
    assert steady_rate_s(result, eight, 1) == pytest.approx(alone)
    # GPipe's (m + K - 1)(F + B) with units of 1 s forward and 2 s backward (two layers at
    # half the batch), then stage 0's half of the 0.5 s step.
    assert alone == pytest.approx((2 + 2 - 1) * (1.0 + 2.0) + 0.5 * 2 / 4)


def test_a_pipeline_layout_records_what_was_simulated() -> None:
    topology = preset("switch-4")
    profile, schedule, costs = _gpipe(8)
    scored = score_pipeline(
        profile, topology, 64 * GB, schedule, "stale", costs, (2, 2), [("gpu0", "gpu2")],
        [NO_PLAN] * 2, mapping="sequential", coordinated=False, batch=1,
    )  # fmt: skip
    assert scored is not None
    layout = scored.layout
    assert layout.family == PIPELINE and layout.placement == (("gpu0", "gpu2"),)
    assert layout.graph_s == simulate(scored.graph, scored.topology).makespan_s
    assert layout.samples_per_s == pytest.approx(
        profile.batch / steady_rate_s(scored.result, schedule, 1)
    )
    assert [p.layers for p in layout.stage_plans] == [("l0", "l1"), ("l2", "l3")]


def test_no_score_when_the_budget_cannot_hold_the_stages() -> None:
    profile, schedule, costs = _gpipe(2)
    scored = score_pipeline(
        profile, preset("switch-4"), GB // 2, schedule, "stale", costs, (2, 2),
        [("gpu0", "gpu1")], [NO_PLAN] * 2, mapping="sequential", coordinated=False, batch=1,
    )  # fmt: skip
    assert scored is None


def test_a_data_parallel_plan_as_a_layout() -> None:
    profile, topology = toy(4), preset("switch-4")
    plan = make_plan(profile, topology, policy="hybrid", gpu_memory_bytes=64 * GB)
    layout = score_data_parallel(plan, profile, topology).layout
    assert layout.family == DATA_PARALLEL and layout.replicas == 4 and layout.stages == 1
    assert layout.samples_per_s == pytest.approx(4 * profile.batch / plan.iteration_s)
    assert layout.graph_s == plan.iteration_s
