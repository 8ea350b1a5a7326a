"""What recomputation can free: the fractional knapsack and its slope.

Covers: pipeswap/swap/plan/bounds/relief.py.
"""

from __future__ import annotations

from pipeswap.swap.plan.bounds.relief import Relief
from pipeswap.swap.plan.workload import workload_from_profile


def test_relief_slope_bounds_less_recomputation(make_profile) -> None:
    # The knapsack is concave in the seconds: its slope at T bounds every s <= T.
    w = workload_from_profile(
        make_profile([(6,), (2,), (3, 1), (0.5,)], 0.05, 0.1, param_bytes=0, output_gb=0.5)
    )
    for seconds in (0.01, 0.04, 0.07, 0.12, 0.2):
        relief = Relief(w, seconds)
        for s in (0.0, seconds / 3, seconds / 2, seconds):
            less = Relief(w, s)
            for k in range(w.num_layers):
                for i in range(k, w.num_layers):
                    ceiling = relief.between(k, i) - relief.slope(k, i) * (seconds - s)
                    assert less.between(k, i) <= ceiling + 1e-3
