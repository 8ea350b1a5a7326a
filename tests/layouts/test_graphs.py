"""layout_graph: one replica without swaps is the pipeline's own graph; swaps, recomputes
and replicas add exactly their tasks, and the simulator keeps every GPU within its memory."""

from __future__ import annotations

import dataclasses

import pytest
from layout_toys import GB, toy

from pipeswap.hardware.presets import preset
from pipeswap.layouts.graphs import layout_graph
from pipeswap.schedule.taskgraph import pipeline_graph
from pipeswap.schedule.timetable import build_schedule
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import TaskGraph
from pipeswap.swap.plan.stage_costs import stage_costs
from pipeswap.swap.plan.stage_swap import NO_PLAN, StagePlan, peak_bytes, stage_order

SCHEDULES = [
    ("gpipe", "stale", 4),
    ("1f1b", "stale", 4),
    ("async-1f1b", "spectrain", 1),
    ("2bw", "stash", 4),
]


@pytest.mark.parametrize("name,weights,micro", SCHEDULES)
def test_one_replica_without_swaps_runs_as_the_pipeline_graph(
    name: str, weights: str, micro: int
) -> None:
    profile, topology = toy(8), preset("switch-4")
    balance = (2, 2, 2, 2)
    schedule = build_schedule(name, 4, 3, micro)
    costs = stage_costs(profile, balance, schedule=name, micro_batches=micro, weights=weights)
    ours = simulate(layout_graph(schedule, costs, [topology.gpus]), topology)
    theirs = simulate(
        pipeline_graph(schedule, profile, topology, balance, weights=weights), topology
    )
    assert ours.makespan_s == pytest.approx(theirs.makespan_s, rel=1e-12)
    for gpu in topology.gpus:
        # The same memory, with the toy's empty working sets.
        assert ours.gpus[gpu].peak_bytes == pytest.approx(theirs.gpus[gpu].peak_bytes, abs=16)


def test_replicas_all_reduce_each_stage_before_its_update() -> None:
    profile, topology = toy(8), preset("single-root-8")
    schedule = build_schedule("1f1b", 4, 2, 4)
    costs = stage_costs(profile, (2, 2, 2, 2), schedule="1f1b", micro_batches=4, weights="stale")
    rows = [topology.gpus[:4], topology.gpus[4:]]
    graph = layout_graph(schedule, costs, rows)
    reduces = [t for t in graph.tasks if t.kind == "allreduce"]
    assert sorted(t.id for t in reduces) == sorted(
        f"s{k}:allreduce{s}" for k in range(4) for s in range(2)
    )
    assert {t.gpus for t in reduces if t.id.startswith("s1:")} == {(rows[0][1], rows[1][1])}
    assert "s2:allreduce1" in graph.task("r1/s2:UPDATE1").deps
    # Without parameters the all-reduces take no time: two replicas run as fast as one.
    weightless = [
        dataclasses.replace(c, param_bytes=0, layer_param_bytes=(0,) * len(c.layers)) for c in costs
    ]
    two = simulate(layout_graph(schedule, weightless, rows), topology).makespan_s
    one = simulate(layout_graph(schedule, weightless, rows[:1]), topology).makespan_s
    assert two == pytest.approx(one, rel=1e-9)
    assert simulate(graph, topology).makespan_s > one


def test_buckets_start_during_the_last_backward_of_a_step() -> None:
    # Two layers of 30 MB per stage: two 25 MiB buckets, the first complete once the
    # stage's last layer has run its backward.
    profile = toy(4, param_bytes=30 * 10**6)
    topology = preset("switch-4")
    schedule = build_schedule("1f1b", 2, 2, 2)
    costs = stage_costs(profile, (2, 2), schedule="1f1b", micro_batches=2, weights="stale")
    rows = [("gpu0", "gpu2"), ("gpu1", "gpu3")]
    graph = layout_graph(schedule, costs, rows)
    assert {"s0:allreduce1.0", "s0:allreduce1", "s1:allreduce1.0", "s1:allreduce1"} <= {
        t.id for t in graph.tasks
    }
    halves = [graph.task("r1/s0:B3.0"), graph.task("r1/s0:B3")]
    assert sum(t.duration_s for t in halves) == pytest.approx(costs[0].backward_s)
    assert graph.task("s0:allreduce1.0").deps == ("r0/s0:B3.0", "r1/s0:B3.0")
    overlapped = simulate(graph, topology).makespan_s
    at_the_end = simulate(layout_graph(schedule, costs, rows, bucket_bytes=None), topology)
    assert overlapped < at_the_end.makespan_s


def test_swaps_and_recomputes_keep_the_simulated_peak_within_the_plans_bound() -> None:
    profile, topology = toy(8), preset("switch-4")
    schedule = build_schedule("1f1b", 4, 2, 4)
    costs = stage_costs(profile, (2, 2, 2, 2), schedule="1f1b", micro_batches=4, weights="stale")
    plans = [
        StagePlan(swapped=frozenset({0}), recomputed=frozenset({1})),
        NO_PLAN,
        NO_PLAN,
        NO_PLAN,
    ]
    graph = layout_graph(schedule, costs, [topology.gpus], plans)
    assert TaskGraph.from_json(graph.to_json()) == graph
    kinds = [t.kind for t in graph.tasks if t.id.startswith("s0:")]
    assert kinds.count("d2h") == kinds.count("h2d") == 8  # one each per unit
    assert graph.task("s0:in3").deps[1] == "s0:out3"
    assert "s0:r3" in graph.task("s0:B3").deps
    bounds = [peak_bytes(stage_order(schedule, k), costs[k], plans[k]) for k in range(4)]
    bound = bounds[0]
    result = simulate(graph, topology.with_gpu_memory(max(bounds)))
    assert result.gpus["gpu0"].peak_bytes <= bound
    plain = simulate(layout_graph(schedule, costs, [topology.gpus]), topology)
    assert result.gpus["gpu0"].peak_bytes < plain.gpus["gpu0"].peak_bytes
    # The recompute adds layer 1's forward to every unit of stage 0.
    busy = result.gpus["gpu0"].busy_s - plain.gpus["gpu0"].busy_s
    assert busy == pytest.approx(8 * 1.0 / 4)


def test_two_stages_on_one_gpu_are_refused() -> None:
    from pipeswap.errors import PipeswapError

    costs = stage_costs(toy(4), (2, 2), schedule="1f1b", micro_batches=2, weights="stale")
    with pytest.raises(PipeswapError, match="two stages on one GPU"):
        layout_graph(build_schedule("1f1b", 2, 1, 2), costs, [("gpu0", "gpu0")])
    assert GB
