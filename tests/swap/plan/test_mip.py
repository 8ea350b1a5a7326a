"""The MIP policy: never slower than the heuristics it starts from, and honest about it.

Covers: pipeswap/swap/plan/mip.py.
"""

from __future__ import annotations

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.planner import make_plan

HEURISTICS = ("oblivious", "disjoint", "bidirectional")


@pytest.mark.parametrize("sync_every", [1, 4])
def test_mip_and_auto_never_slower_than_any_heuristic(make_profile, sync_every) -> None:
    profile = make_profile([(6,)] * 6, 0.25, 0.5)
    common = dict(gpus=2, footprint_ratio=2.0, sync_every=sync_every, time_limit_s=2)
    # Every policy but the MIP and auto: the swap heuristics, the baselines and hybrid.
    heuristics = [
        make_plan(profile, preset("switch-4"), policy=p, **common)
        for p in HEURISTICS + ("recompute", "save-on-cpu", "hybrid")
    ]
    heuristics = [r for r in heuristics if r.fits]
    mip = make_plan(profile, preset("switch-4"), policy="mip", **common)
    auto = make_plan(profile, preset("switch-4"), policy="auto", **common)
    fastest = min(r.iteration_s for r in heuristics)
    assert mip.iteration_s <= fastest + 1e-12
    assert auto.iteration_s <= min(fastest, mip.iteration_s) + 1e-12
    assert auto.solve_s <= 2 * 1.05  # within its time limit (plus the final report)
    # Both estimates are reported: the MIP's own and the simulator's.
    assert mip.notes["mip_estimate_s"] > 0
    assert "mip_simulated_s" in mip.notes
    assert mip.notes["warm_start"] in HEURISTICS + ("recompute", "save-on-cpu", "hybrid")
    assert mip.mip_gap is not None and 0.0 <= mip.mip_gap <= 1.0


def test_single_gpu_mip_matches_fluid_optimum_on_an_easy_case(make_profile) -> None:
    # One GPU must have 1 GB of layers 0-1 off the GPU during forward 2: layer 0's 6 GB
    # leave during forward 1 (1 s at 12 GB/s) and return during backward 2 and 1 (4 s):
    # the copies hide completely, so the MIP predicts no stall and the simulation agrees.
    profile = make_profile([(6,), (6,), (1,)], 1.0, 2.0)
    result = make_plan(
        profile,
        preset("switch-4"),
        policy="mip",
        gpus=1,
        gpu_memory_bytes=2 * 3 * 10**7 + 12 * 10**9,
        time_limit_s=5,
    )
    assert result.notes["mip_estimate_s"] == pytest.approx(result.compute_s)
    assert result.iteration_s == pytest.approx(result.compute_s, rel=1e-9)


def test_mip_predicts_the_unavoidable_wait(make_profile) -> None:
    # Forward 1 needs 5 GB of layer 0 gone, which only exists once forward 0 ends: the
    # fluid MIP predicts exactly 5 GB / 12 GB/s of stall; the simulator moves the whole
    # 6 GB tensor and waits 0.5 s.
    profile = make_profile([(6,), (6,), (1,)], 1.0, 2.0)
    result = make_plan(
        profile,
        preset("switch-4"),
        policy="mip",
        gpus=1,
        gpu_memory_bytes=2 * 3 * 10**7 + 7 * 10**9,
        time_limit_s=5,
    )
    assert result.notes["mip_estimate_s"] == pytest.approx(9.0 + 5 / 12)
    assert result.iteration_s >= result.notes["mip_estimate_s"]
