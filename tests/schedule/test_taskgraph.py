"""Schedule + profile + topology -> task graph; simulated makespans match closed forms.

Covers: pipeswap/schedule/taskgraph.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from support import toy_layer, toy_profile_of

from pipeswap.hardware.topology import Link, Node, Topology
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.taskgraph import pipeline_graph, pipeline_task_graph
from pipeswap.schedule.timetable import build_schedule
from pipeswap.sim.engine import simulate


def _topology(gpus: int = 4) -> Topology:
    nodes = [Node("cpu0", "cpu"), Node("sw0", "switch")]
    nodes += [Node(f"gpu{i}", "gpu", memory_bytes=0) for i in range(gpus)]
    links = [Link(f"gpu{i}", "sw0", 10.0) for i in range(gpus)] + [Link("sw0", "cpu0", 10.0)]
    return Topology("switch4", tuple(nodes), tuple(links))


def _profile(layers: int, micro: int, output_bytes: int = 0) -> Profile:
    # Per mini-batch: each layer 1 s forward, 1 s backward per unit of 1/micro of the batch.
    return toy_profile_of(
        (
            toy_layer(
                f"l{i}",
                float(micro),
                float(micro),
                param_bytes=1000,
                output_bytes=output_bytes,
                saved=[400 * micro],
            )
            for i in range(layers)
        ),
        batch=8,
        device="cpu",
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_sync_makespan_matches_closed_form(name: str) -> None:
    stages, micro, steps = 4, 4, 2
    schedule = build_schedule(name, stages, steps, micro)
    graph = pipeline_graph(schedule, _profile(4, micro), _topology(), (1, 1, 1, 1))
    result = simulate(graph, _topology())
    assert result.makespan_s == pytest.approx(steps * 2 * (micro + stages - 1))


def test_async_makespan_and_memory() -> None:
    stages, steps = 4, 8
    schedule = build_schedule("async-1f1b", stages, steps)
    topology = _topology()
    graph = pipeline_graph(schedule, _profile(4, 1), topology, (1, 1, 1, 1), weights="stash")
    result = simulate(graph, topology)
    assert result.makespan_s == pytest.approx(2 * steps + 2 * (stages - 1))
    for k in range(stages):
        in_flight = stages - k
        # Weights + gradients + one stash per in-flight mini-batch, plus their activations.
        assert result.gpus[f"gpu{k}"].peak_bytes == (2 + in_flight) * 1000 + in_flight * 400


def test_transfers_cost_time_and_appear_as_p2p() -> None:
    schedule = build_schedule("1f1b", 2, 1, 2)
    obj = pipeline_task_graph(schedule, _profile(2, 2, output_bytes=10**9), _topology(2), (1, 1))
    p2p = [t for t in obj["tasks"] if t["kind"] == "p2p"]
    assert obj["format"] == "pipeswap.graph/1"
    assert len(p2p) == 4 and all(t["bytes"] == 5 * 10**8 for t in p2p)
    assert {(t["src"], t["dst"]) for t in p2p} == {("gpu0", "gpu1"), ("gpu1", "gpu0")}
    free = simulate(pipeline_graph(schedule, _profile(2, 2), _topology(2), (1, 1)), _topology(2))
    costly = simulate(
        pipeline_graph(schedule, _profile(2, 2, 10**9), _topology(2), (1, 1)), _topology(2)
    )
    assert costly.makespan_s > free.makespan_s


def test_each_update_takes_its_stages_share_of_the_timed_optimizer_step() -> None:
    schedule = build_schedule("gpipe", 2, 1, 2)
    profile = replace(_profile(3, 2), optimizer_step_s=3.0)  # 1000 parameter bytes a layer
    tasks = pipeline_task_graph(schedule, profile, _topology(2), (2, 1))["tasks"]
    updates = {t["id"]: t["duration_s"] for t in tasks if "UPDATE" in t["id"]}
    assert updates == {"s0:UPDATE0": pytest.approx(2.0), "s1:UPDATE0": pytest.approx(1.0)}
    given = pipeline_task_graph(schedule, profile, _topology(2), (2, 1), update_s=0.5)["tasks"]
    assert {t["duration_s"] for t in given if "UPDATE" in t["id"]} == {0.5}
    untimed = pipeline_task_graph(schedule, _profile(3, 2), _topology(2), (2, 1))["tasks"]
    assert {t["duration_s"] for t in untimed if "UPDATE" in t["id"]} == {0.0}
