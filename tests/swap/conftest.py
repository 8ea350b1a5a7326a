"""Small hand-checkable profiles for the swap planner tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from pipeswap.profile import LayerProfile, Profile, SavedTensor
from pipeswap.swap.plan.workload import Workload, workload_from_profile

GB = 10**9

ProfileFactory = Callable[..., Profile]


def toy_profile(
    sizes_gb: Sequence[Sequence[float]],
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    param_bytes: int = GB // 100,
    workspace_bytes: int = 0,
    output_gb: float = 0.0,
) -> Profile:
    """One layer per entry of ``sizes_gb``, each saving tensors of those sizes (GB); every
    layer's output is ``output_gb`` (what a recomputed next layer keeps)."""
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward_s=forward_s,
            backward_s=backward_s,
            param_bytes=param_bytes,
            output_bytes=int(output_gb * GB),
            saved=tuple(SavedTensor(k, int(size * GB)) for k, size in enumerate(sizes)),
            workspace_bytes=workspace_bytes,
        )
        for i, sizes in enumerate(sizes_gb)
    )
    return Profile("toy", 1, "float32", "estimate", "toy-gpu", "sgd", 0, layers)


@pytest.fixture
def make_profile() -> ProfileFactory:
    return toy_profile


@pytest.fixture
def four_layers() -> tuple[Workload, int]:
    """Saved 6 GB per layer, forward 1/16 s, backward 1/8 s, no weights: peak 24 GB; and a
    budget that leaves 12 GB to move (D / B = 1 s at 12 GB/s)."""
    w = workload_from_profile(toy_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0))
    return w, w.no_swap_peak_bytes() - 12 * GB
