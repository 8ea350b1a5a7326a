"""The shared-link terms of the turn bound: the shared channel and the edges of a sync.

Covers: pipeswap/swap/plan/bounds/sharing.py.
"""

from __future__ import annotations

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.bounds.inputs import BoundInputs
from pipeswap.swap.plan.bounds.link import lower_bound
from pipeswap.swap.plan.bounds.sharing import channel_terms
from pipeswap.swap.plan.bounds.turn import _turn_bound, turn_bound
from pipeswap.swap.plan.planner import make_case
from pipeswap.swap.plan.policy_table import POLICIES
from pipeswap.swap.plan.scoring import Assignment

RULES = {name: p.assign for name, p in POLICIES.items() if p.assign is not None}
GB = 10**9


def test_turn_bound_shared_uplink_closed_form(four_layers) -> None:
    w, budget = four_layers
    bound = turn_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=1, recompute=False
    )
    # 2 x 12 GB leave through sw0's uplink after forward 0 (1/16 s) and before forward 3
    # of the last GPU, which still has 1/16 + 1/2 s to run: 1/16 + 2 + 9/16.
    assert bound.channel_s["sw0<->cpu0 swap-outs"] == pytest.approx(2.625)
    # Back: after backward 3 of the first micro-batch ends (1/4 + 1/8 s: it holds its
    # memory to its end) and before backward 0 (1/8 s): 1/4 + 1/8 + 2 + 1/8.
    assert bound.channel_s["sw0<->cpu0 prefetches"] == pytest.approx(2.5)
    design = lower_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=1, recompute=False
    )
    assert design.bound_s == pytest.approx(2.0)


def test_sharing_terms_closed_form(four_layers) -> None:
    w, budget = four_layers
    bound = turn_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=1, recompute=False
    )
    # First micro-batch: 2 x 12 GB of layers 0-2 leave after forward 0 (1/16 s) before the
    # later GPU's forward 3 starts (2 1/16 s); it then runs forward 3 (1/16 s) and the
    # shortest backward of the one-GPU recursion (1/8 s, 1 s of prefetch, 1/8 s).
    assert bound.channel_s["sw0<->cpu0 first swap-outs"] == pytest.approx(3.375)
    # Last micro-batch: the earlier GPU ends backward 3 at 1 1/4 s at best; then 2 x 12 GB
    # come back (2 s) before the last backward 0 (1/8 s).
    assert bound.channel_s["sw0<->cpu0 last prefetches"] == pytest.approx(3.375)
    assert bound.bound_s == pytest.approx(3.375)
    # With three micro-batches the late GPU still runs two more of at least 2.375 s each,
    # more than the per-GPU term (3 x 2.375) and the amortized channel term.
    three = turn_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=3, recompute=False
    )
    assert three.channel_s["sw0<->cpu0 first swap-outs"] == pytest.approx(3.375 + 2 * 2.375)
    assert three.channel_s["sw0<->cpu0 swap-outs"] == pytest.approx(1 / 16 + 6 + 9 / 16)
    assert three.bound_s == pytest.approx(8.125)
    # A GPU alone on its link gets no sharing terms.
    alone = turn_bound(
        w, preset("switch-4"), ["gpu0", "gpu2"], budget, sync_every=1, recompute=False
    )
    assert not any("first" in name or "last" in name for name in alone.channel_s)


@pytest.mark.parametrize("sync_every, expected", [(1, 3.375), (3, 8.125)])
def test_bidirectional_reaches_the_sharing_bound(
    four_layers, make_profile, sync_every, expected
) -> None:
    # The closed form above is attained: the late GPU starts once the early one's 12 GB
    # are out, and pays that once per sync; nothing faster exists, and bidirectional finds it.
    w, budget = four_layers
    profile = make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0)
    case = make_case(
        profile, preset("switch-4"), gpus=2, gpu_memory_bytes=budget, sync_every=sync_every
    )
    bound = turn_bound(w, case.topology, case.gpus, budget, sync_every=sync_every, recompute=False)
    assert bound.bound_s == pytest.approx(expected)
    plan = RULES["bidirectional"](case)
    assert case.score(plan).iteration_s == pytest.approx(expected)


def test_shared_uplink_with_recompute_closed_form(four_layers, make_profile) -> None:
    # Two GPUs behind sw0 (12 GB/s) must each free 12 GB before forward 3; recomputing s
    # seconds frees at most 96 s GB (6 GB per 1/16 s). With both recomputing at most T,
    # the GPU that recomputes least (s) leaves 12 - 96 s GB, the other 12 - 96 T, and the
    # later GPU still re-runs s seconds after its forward 3: 1/16 + (24 - 96 (T + s)) / 12
    # + 9/16 + s, least at s = T: 2.625 - 15 T (not 2.625 - 16 T: the re-run is counted).
    w, budget = four_layers
    inputs = BoundInputs.of(w, preset("switch-4"), ["gpu0", "gpu1"], budget, 1).allowing(0.05)
    terms = _turn_bound(inputs, 0.05).channel_s
    assert channel_terms(inputs).items() <= terms.items()  # the shared-channel family
    assert terms["sw0<->cpu0 swap-outs"] == pytest.approx(2.625 - 15 * 0.05)
    # It meets the compute of a GPU recomputing T, 0.75 + T, at T = 15/128.
    bound = turn_bound(w, preset("switch-4"), ["gpu0", "gpu1"], budget)
    assert bound.bound_s == pytest.approx(0.75 + 15 / 128, rel=1e-6)
    assert bound.bound_s <= 0.75 + 15 / 128 + 1e-12  # never above the true minimum
    assert bound.recompute_s == pytest.approx(15 / 128, rel=1e-4)
    # Two whole layers recomputed per GPU free the 12 GB: 0.875 s, above the bound.
    case = make_case(
        make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0),
        preset("switch-4"),
        gpus=2,
        gpu_memory_bytes=budget,
    )
    two = Assignment(
        {g: () for g in case.gpus}, recompute={g: frozenset((0, 1)) for g in case.gpus}
    )
    assert case.score(two).iteration_s == pytest.approx(0.875)
