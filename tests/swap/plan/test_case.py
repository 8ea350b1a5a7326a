"""The planning problem: scores remembered per assignment, one channel group standing for all.

Covers: pipeswap/swap/plan/case.py.
"""

from __future__ import annotations

from pipeswap.hardware.presets import preset
from pipeswap.sim.engine import simulate
from pipeswap.swap.plan.case import Case, all_tensors
from pipeswap.swap.plan.planner import make_case
from pipeswap.swap.plan.scoring import Assignment
from pipeswap.swap.plan.tensors import SwapDecisionAt
from pipeswap.swap.plan.workload import workload_from_profile

GB = 10**9


def test_all_tensors_lists_every_non_empty_saved_tensor_in_forward_order(make_profile) -> None:
    w = workload_from_profile(make_profile([(4, 0), (2,), (3, 1)]))
    assert all_tensors(w) == [(0, 0, 4 * GB), (1, 0, 2 * GB), (2, 0, 3 * GB), (2, 1, GB)]


def test_an_assignment_is_simulated_once_and_reproducible(make_profile) -> None:
    case = make_case(
        make_profile([(4,), (2,), (3,)]), preset("switch-4"), gpus=2, gpu_memory_bytes=6 * GB
    )
    assert isinstance(case, Case) and case.topology.node("gpu0").memory_bytes == 6 * GB
    swaps = {gpu: (SwapDecisionAt(0, 0, 4 * GB, 0, 1),) for gpu in case.gpus}
    first = case.score(Assignment(swaps))
    # An equal assignment (a new object) is answered from memory.
    assert case.score(Assignment(dict(swaps), {})) is first
    assert case.score(Assignment(swaps, {"gpu1": 0.5})) is not first
    # The scored graph re-simulates to the same numbers on the case's topology.
    assert simulate(first.graph, case.topology).makespan_s == first.iteration_s


def test_reduced_keeps_one_of_several_equal_channel_groups(make_profile) -> None:
    profile = make_profile([(4,), (2,), (3,)])
    case = make_case(profile, preset("switch-4"), gpu_memory_bytes=6 * GB)
    assert case.reduced().gpus == ("gpu0", "gpu1")  # switch-4: two switches of two GPUs
    alone = make_case(profile, preset("switch-4"), gpus=["gpu0", "gpu1"], gpu_memory_bytes=6 * GB)
    assert alone.reduced() is alone  # one group: nothing to reduce
