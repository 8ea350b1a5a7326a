"""design.md's link bound: compute, or the bytes the busiest directed link must carry.

Covers: pipeswap/swap/plan/bounds/link.py.
"""

from __future__ import annotations

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.bounds.link import lower_bound
from pipeswap.swap.plan.workload import workload_from_profile

GB = 10**9


def test_compute_bound_when_nothing_must_move(make_profile) -> None:
    w = workload_from_profile(make_profile([(6,)] * 4, param_bytes=0))
    bound = lower_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], 10**12, sync_every=2, recompute=False
    )
    assert bound.binding == "compute"
    assert bound.bound_s == pytest.approx(2 * 4 * 3.0)
    assert bound.min_swap_bytes == 0


def test_shared_uplink_bound(make_profile) -> None:
    # 4 layers of 6 GB, compute 0.75 s per micro-batch; budget leaves 12 GB to move each way.
    w = workload_from_profile(make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0))
    budget = w.no_swap_peak_bytes() - 12 * GB
    bound = lower_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=1, recompute=False
    )
    # Two GPUs behind sw0 push 2 * 12 GB through the 12 GB/s uplink: 2 s each direction.
    assert bound.link_s["sw0->cpu0"] == pytest.approx(2.0)
    assert bound.link_s["cpu0->sw0"] == pytest.approx(2.0)
    assert bound.link_s["gpu0->sw0"] == pytest.approx(1.0)
    assert bound.bound_s == pytest.approx(2.0)
    assert bound.binding in ("sw0->cpu0", "cpu0->sw0")


def test_link_bound_with_recompute_closed_form(four_layers) -> None:
    # One GPU, 4 layers of 6 GB, forward 1/16 s each (96 GB freed per recompute second),
    # 12 GB must go: recomputing T seconds leaves 12 - 96 T GB for the 12 GB/s link
    # (1 - 8 T s) and adds T to the 0.75 s of compute; they cross at T = 1/36.
    w, budget = four_layers
    swap_only = lower_bound(w, preset("switch-4"), ["gpu0"], budget, recompute=False)
    assert swap_only.bound_s == pytest.approx(1.0)
    bound = lower_bound(w, preset("switch-4"), ["gpu0"], budget)
    assert bound.bound_s == pytest.approx(0.75 + 1 / 36, rel=1e-6)
    assert bound.bound_s <= 0.75 + 1 / 36 + 1e-12  # never above the true minimum
    assert bound.recompute_s == pytest.approx(1 / 36, rel=1e-4)
