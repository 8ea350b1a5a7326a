"""The turn bound: its terms put together, and its minimum over the recompute seconds.

Covers: pipeswap/swap/plan/bounds/turn.py.
"""

from __future__ import annotations

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.bounds.turn import turn_bound
from pipeswap.swap.plan.planner import make_case
from pipeswap.swap.plan.scoring import Assignment
from pipeswap.swap.plan.workload import workload_from_profile

GB = 10**9


def test_turn_bound_is_compute_when_nothing_must_move(make_profile) -> None:
    w = workload_from_profile(make_profile([(6,)] * 4, param_bytes=0))
    bound = turn_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], 10**12, sync_every=2, recompute=False
    )
    assert bound.bound_s == pytest.approx(w.compute_s(2))
    assert bound.channel_s == {}


def test_turn_bound_with_recompute_is_below_swap_only_and_above_compute(
    four_layers, make_profile
) -> None:
    w, budget = four_layers
    swap_only = turn_bound(w, preset("switch-4"), ["gpu0", "gpu1"], budget, recompute=False)
    both = turn_bound(w, preset("switch-4"), ["gpu0", "gpu1"], budget)
    assert w.compute_s(1) < both.bound_s < swap_only.bound_s
    # Recomputing everything costs 1/4 s and moves nothing: no bound may exceed that.
    assert both.bound_s <= w.compute_s(1) + 0.25 + 1e-9
    everything = Assignment(
        {g: () for g in ("gpu0", "gpu1")},
        recompute={g: frozenset(range(4)) for g in ("gpu0", "gpu1")},
    )
    case = make_case(
        make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0),
        preset("switch-4"),
        gpus=2,
        gpu_memory_bytes=budget,
    )
    assert case.score(everything).iteration_s == pytest.approx(1.0)
    assert case.score(everything).iteration_s >= both.bound_s


def test_nothing_worth_recomputing_keeps_the_swap_only_bounds(make_profile) -> None:
    # Each layer keeps a 6 GB input for 6 GB of saved tensors (layer 0 saves nothing):
    # recomputing frees nothing.
    w = workload_from_profile(
        make_profile([()] + [(6,)] * 3, 0.0625, 0.125, param_bytes=0, output_gb=6)
    )
    budget = w.no_swap_peak_bytes() - 6 * GB
    assert all(freed <= 0 for freed in w.freed_bytes)
    assert (
        turn_bound(w, preset("switch-4"), ["gpu0"], budget).bound_s
        == turn_bound(w, preset("switch-4"), ["gpu0"], budget, recompute=False).bound_s
    )
