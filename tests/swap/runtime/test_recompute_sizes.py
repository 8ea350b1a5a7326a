"""What recomputing each layer keeps and saves again, as a profile records it.

Covers: pipeswap/swap/runtime/recompute_sizes.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.swap.runtime.recompute_sizes import RecomputeSizes, measure_recomputation
from pipeswap.swap.runtime.selective import SelectiveChoice

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_layer_s_fields_are_whole_selective_and_the_state_it_keeps() -> None:
    choice = SelectiveChoice(frozenset(), cached_bytes=100, rerun_bytes=40, rerun_fraction=0.25)
    sizes = RecomputeSizes(
        {}, {"a": 1000}, {"a": 600}, {"a": 64}, {"a": choice}, {"a": ("x", "y[0]")}
    )
    assert sizes.profile_fields("a", 2.0) == {
        "kept_bytes": 1000,
        "rerun_bytes": 600,
        "rerun_output_bytes": 64,
        "held_state": "x, y[0]",
        "selective_kept_bytes": 1100,
        "selective_rerun_bytes": 40,
        "selective_rerun_s": 0.5,
    }
    # A layer measured for nothing has no fields of substance.
    assert sizes.profile_fields("b", 1.0) == {
        "kept_bytes": None,
        "rerun_bytes": None,
        "rerun_output_bytes": None,
        "held_state": None,
    }


def test_a_re_run_saves_what_the_layer_saved_but_its_input() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(n, 64), nn.Tanh()) for n in (32, 64))
    x = torch.randn(8, 32)

    def forward() -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h)
        return h.sum()

    layers = {str(i): b for i, b in enumerate(blocks)}
    sizes = measure_recomputation(blocks, layers, list(layers), forward, selective=False)
    # Each block saves its input (8x32 or 8x64 floats) and tanh's output (8x64): its re-run
    # saves all but the input it keeps.
    assert sizes.rerun == {"0": 8 * 64 * 4, "1": 8 * 64 * 4}
    assert sizes.held == {} and sizes.choices == {}
