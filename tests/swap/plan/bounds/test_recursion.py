"""The per-GPU recursions: the shortest micro-batch a GPU's own path allows.

Covers: pipeswap/swap/plan/bounds/recursion.py.
"""

from __future__ import annotations

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.bounds.recursion import shortest_microbatch_s
from pipeswap.swap.plan.bounds.turn import turn_bound

GB = 10**9


def test_turn_bound_one_gpu_closed_form(four_layers) -> None:
    w, budget = four_layers
    assert w.needs(budget) == [0, 0, 6 * GB, 12 * GB]
    # Forward 2 waits for 6 GB of layer 0 (out from 1/16 s, 1/2 s); forward 3 for 12 GB
    # (from 1/16 s, 1 s): the turn is at 1.125 s. Backward 3 holds its memory for 1/8 s;
    # only then may the 12 GB of layers 0-1 start coming back: 1 s more, then backward 0.
    assert shortest_microbatch_s(w, budget, 12e9) == pytest.approx(2.375)
    # The simple form max(F, D/B) + max(Bk, D/B) = 1 + 1 is weaker, never stronger.
    bound = turn_bound(w, preset("switch-4"), ["gpu0"], budget, sync_every=3, recompute=False)
    assert bound.bound_s == pytest.approx(3 * 2.375)
    assert bound.binding == "gpu0"
    assert bound.tail_s == 0.0  # no optimizer step known for toy-gpu, no all-reduce
