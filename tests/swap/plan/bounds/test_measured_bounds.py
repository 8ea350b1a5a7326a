"""The bounds on a measured profile, whose forward and backward points differ.

A measured profile's backward working sets hold the gradients made so far, its last
forward the turn: the bytes that must be off the GPU during forward i (``need_F``) and
during backward i (``need_B``) are not one number. A bound that made forward i wait for
the larger of the two was beaten by the planner's own plans (data/gpt2_tiny_measured.json,
a gpt2-tiny profile measured on CPU, 2 GPUs of switch-4 at 3287560 bytes: disjoint ran
0.0093993 s against a swap-only turn bound of 0.0094262 s).

Covers: pipeswap/swap/plan/bounds/ (inputs.py's needs, the recursions and shared terms).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.profiling.profile import Profile
from pipeswap.swap.plan.bounds.inputs import BoundInputs
from pipeswap.swap.plan.bounds.turn import turn_bound
from pipeswap.swap.plan.planner import make_plan
from pipeswap.swap.plan.policy_table import POLICIES
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.swap_config import DEFAULT_BUCKET_BYTES

PROFILE = Path(__file__).parent / "data" / "gpt2_tiny_measured.json"
BUDGET = 3287560


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.load(PROFILE)


def test_forward_and_backward_needs_are_each_points_excess(profile) -> None:
    w = workload_from_profile(profile)
    micro = BoundInputs.of(w, preset("switch-4"), ["gpu0", "gpu1"], BUDGET, 1).micro
    forward, backward = w.memory_points(())
    assert micro.forward_needs == [max(0, p - BUDGET) for p in forward]
    assert micro.backward_needs == [max(0, p - BUDGET) for p in backward]
    # Forward 2 needs nothing off the GPU; only its backward (gradients held) does.
    assert micro.forward_needs[:3] == [0, 0, 0] and micro.backward_needs[2] > 300_000
    assert micro.needs == [max(f, b) for f, b in zip(micro.forward_needs, micro.backward_needs)]
    assert micro.needs != micro.forward_needs and micro.needs != micro.backward_needs


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_policy_beats_the_bounds_on_a_measured_profile(profile, policy) -> None:
    topology = preset("switch-4")
    try:
        result = make_plan(
            profile, topology, gpus=2, policy=policy, gpu_memory_bytes=BUDGET, time_limit_s=1.0
        )
    except PipeswapError:
        pytest.skip(f"{policy} plans nothing at this budget")
    if not result.fits:
        return  # a baseline that ignores the budget is not bound by it
    seconds = result.iteration_s
    assert seconds >= result.lower_bound_s * (1 - 1e-9)
    assert seconds >= result.turn_bound_s * (1 - 1e-9), (seconds, result.turn.binding)
    if not any(gpu.recompute for gpu in result.plan.gpus):
        swap_only = turn_bound(
            workload_from_profile(profile),
            topology,
            ["gpu0", "gpu1"],
            BUDGET,
            bucket_bytes=DEFAULT_BUCKET_BYTES,
            recompute=False,
        )
        assert seconds >= swap_only.bound_s * (1 - 1e-9), (seconds, swap_only.binding)
