"""Scoring an assignment: the simulation of exactly the graph it produces.

Covers: pipeswap/swap/plan/scoring.py.
"""

from __future__ import annotations

from pipeswap.hardware.presets import preset
from pipeswap.sim.engine import simulate
from pipeswap.swap.plan.iteration import build_iteration_graph
from pipeswap.swap.plan.scoring import Assignment, score
from pipeswap.swap.plan.tensors import SwapDecisionAt
from pipeswap.swap.plan.workload import workload_from_profile

GB = 10**9


def test_an_assignment_says_what_each_gpu_swaps_and_recomputes() -> None:
    swaps = {"gpu0": (SwapDecisionAt(0, 0, 4 * GB, 0, 1), SwapDecisionAt(1, 0, 2 * GB, 1, 3))}
    assignment = Assignment(swaps, recompute={"gpu1": frozenset({2})})
    assert assignment.swapped_bytes("gpu0") == 6 * GB
    assert assignment.swapped_bytes("gpu1") == 0
    assert assignment.recomputed("gpu1") == {2} and assignment.recomputed("gpu0") == frozenset()


def test_the_score_is_the_simulation_of_the_assignments_graph(make_profile) -> None:
    w = workload_from_profile(make_profile([(4,), (2,), (3,)]))
    topology = preset("switch-4").with_gpu_memory(w.resident_bytes + 6 * GB)
    gpus = ["gpu0", "gpu1"]
    swaps = {
        "gpu0": (SwapDecisionAt(0, 0, 4 * GB, 0, 1),),
        "gpu1": (SwapDecisionAt(0, 0, 4 * GB, 0, 2),),
    }
    assignment = Assignment(swaps, {"gpu1": 0.25}, {"gpu1": frozenset({1})})
    scored = score(w, topology, gpus, assignment, sync_every=2, bucket_bytes=GB)
    graph = build_iteration_graph(
        w,
        gpus,
        swaps,
        offsets_s={"gpu1": 0.25},
        recompute={"gpu1": frozenset({1})},
        sync_every=2,
        bucket_bytes=GB,
    )
    assert scored.graph.to_json() == graph.to_json()
    assert scored.iteration_s == simulate(graph, topology).makespan_s == scored.result.makespan_s
    assert scored.assignment is assignment
