"""Small hand-checkable profiles for the swap planner tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support import GB, toy_profile

from pipeswap.profiling.profile import Profile
from pipeswap.swap.plan.workload import Workload, workload_from_profile

ProfileFactory = Callable[..., Profile]


@pytest.fixture
def make_profile() -> ProfileFactory:
    return toy_profile


@pytest.fixture
def four_layers() -> tuple[Workload, int]:
    """Saved 6 GB per layer, forward 1/16 s, backward 1/8 s, no weights: peak 24 GB; and a
    budget that leaves 12 GB to move (D / B = 1 s at 12 GB/s)."""
    w = workload_from_profile(toy_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0))
    return w, w.no_swap_peak_bytes() - 12 * GB
