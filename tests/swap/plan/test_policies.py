"""Each heuristic on hand-made workloads where the winner is known in advance.

Covers: pipeswap/swap/plan/policies.py (with channels.py and scoring.py underneath).
"""

from __future__ import annotations

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.planner import make_plan

GB = 10**9
HEURISTICS = ("oblivious", "disjoint", "bidirectional")


def _tensor_sets(result) -> list[set[tuple[str, int]]]:
    return [{(s.layer, s.index) for s in g.swaps} for g in result.plan.gpus]


def test_nothing_to_swap_when_the_peak_fits(make_profile) -> None:
    profile = make_profile([(6,)] * 4)
    topology = preset("switch-4")
    none = make_plan(profile, topology, policy="none", gpus=2, footprint_ratio=1.0)
    assert none.fits
    for policy in HEURISTICS:
        result = make_plan(profile, topology, policy=policy, gpus=2, footprint_ratio=1.0)
        assert all(g.swapped_bytes == 0 for g in result.gpus)
        assert all(g.offset_s == 0 for g in result.gpus)
        assert result.iteration_s == pytest.approx(none.iteration_s)


def test_disjoint_beats_oblivious_when_tensors_are_plentiful(make_profile) -> None:
    # Eight layers of 6 GB (the last 12 GB), 0.25 s forward, 0.5 s backward; two GPUs share
    # sw0's 12 GB/s uplink and must each move 12 GB. Oblivious swaps layers 0 and 1 on
    # both GPUs at once (4 x 6 GB through the uplink together); disjoint gives the eight
    # early layers out in turns, so each copy mostly has the uplink to itself.
    profile = make_profile([(6,)] * 7 + [(12,)], 0.25, 0.5)
    budget = 2 * 8 * GB // 100 + 42 * GB
    common = dict(gpus=2, gpu_memory_bytes=budget, sync_every=4)
    oblivious = make_plan(profile, preset("switch-4"), policy="oblivious", **common)
    disjoint = make_plan(profile, preset("switch-4"), policy="disjoint", **common)
    a, b = _tensor_sets(oblivious)
    assert a == b == {("l0", 0), ("l1", 0)}
    a, b = _tensor_sets(disjoint)
    assert not a & b
    assert disjoint.iteration_s < oblivious.iteration_s - 1.0


def test_bidirectional_beats_both_when_the_channel_is_saturated(make_profile) -> None:
    # Six layers of 6 GB, forward 0.25 s, backward 0.5 s, half of the peak must go: both
    # GPUs swap the same 24 GB, so disjoint cannot help; offsetting one GPU lets its
    # swap-outs use the uplink while its neighbour's prefetches use the other direction.
    profile = make_profile([(6,)] * 6, 0.25, 0.5)
    common = dict(gpus=2, footprint_ratio=2.0, sync_every=4)
    results = {p: make_plan(profile, preset("switch-4"), policy=p, **common) for p in HEURISTICS}
    bidirectional = results["bidirectional"]
    assert bidirectional.iteration_s < 0.75 * results["oblivious"].iteration_s
    assert bidirectional.iteration_s < 0.75 * results["disjoint"].iteration_s
    offsets = sorted(g.offset_s for g in bidirectional.gpus)
    assert offsets[0] == 0 and offsets[1] > 0


@pytest.mark.parametrize("policy", ("none",) + HEURISTICS)
@pytest.mark.parametrize("topology", ["switch-4", "dual-root-8"])
def test_every_plan_stays_within_its_budget(make_profile, policy, topology) -> None:
    profile = make_profile([(3, 1), (2,), (4, 2), (1,), (2, 2)], 0.1, 0.2, workspace_bytes=GB)
    ratio = 1.0 if policy == "none" else 1.6
    result = make_plan(
        profile, preset(topology), policy=policy, footprint_ratio=ratio, sync_every=2
    )
    assert result.fits
    for gpu in result.gpus:
        assert gpu.peak_bytes <= gpu.budget_bytes
    assert result.iteration_s >= result.lower_bound_s - 1e-9


def test_late_members_are_every_second_gpu_of_each_channel(make_profile) -> None:
    from pipeswap.swap.plan.planner import make_case
    from pipeswap.swap.plan.policies import late_members

    case = make_case(make_profile([(6,)] * 4), preset("single-root-8"), footprint_ratio=1.5)
    assert late_members(case) == ["gpu1", "gpu3", "gpu5", "gpu7"]
    alone = make_case(make_profile([(6,)] * 4), preset("direct-4"), footprint_ratio=1.5)
    assert late_members(alone) == []


# ---- the PyTorch baselines and hybrid ------------------------------------------------------
def test_save_on_cpu_swaps_every_tensor_after_its_layer_and_fetches_it_when_needed(
    make_profile,
) -> None:
    profile = make_profile([(3, 1), (2,), (4, 2)], 0.1, 0.2)
    result = make_plan(
        profile, preset("switch-4"), policy="save-on-cpu", gpus=2, footprint_ratio=1.5
    )
    assert result.fits
    for gpu in result.plan.gpus:
        assert {(s.layer, s.index) for s in gpu.swaps} == {
            ("l0", 0),
            ("l0", 1),
            ("l1", 0),
            ("l2", 0),
            ("l2", 1),
        }
        assert all(s.out_after == s.layer for s in gpu.swaps)
        following = {"l0": "l1", "l1": "l2", "l2": None}  # the last layer: at the turn
        assert all(s.prefetch_after == following[s.layer] for s in gpu.swaps)
        assert gpu.offset_s == 0 and gpu.recompute == ()


def test_recompute_recomputes_every_block(make_profile) -> None:
    profile = make_profile([(3, 1), (2,), (4, 2)], 0.1, 0.2)
    result = make_plan(profile, preset("switch-4"), policy="recompute", gpus=2, footprint_ratio=1.5)
    assert result.fits
    assert all(g.recompute == ("l0", "l1", "l2") and not g.swaps for g in result.plan.gpus)
    # Three forwards again per micro-batch, nothing on the link: the unlimited no-swap
    # iteration (its all-reduce included) plus 0.3 s.
    none = make_plan(profile, preset("switch-4"), policy="none", gpus=2, footprint_ratio=1.5)
    assert result.iteration_s == pytest.approx(none.iteration_s + 0.3)


def test_hybrid_recomputes_where_the_link_is_the_bottleneck(make_profile) -> None:
    # Two GPUs behind one switch must each move half of 36 GB per micro-batch: the link
    # bounds every swap-only plan; recomputing a forward of 0.25 s frees 6 GB.
    profile = make_profile([(6,)] * 6, 0.25, 0.5)
    common = dict(gpus=2, footprint_ratio=2.0, sync_every=4)
    swap_only = min(
        make_plan(profile, preset("switch-4"), policy=p, **common).iteration_s for p in HEURISTICS
    )
    hybrid = make_plan(profile, preset("switch-4"), policy="hybrid", **common)
    assert hybrid.iteration_s < swap_only / 1.1
    assert any(g.recompute for g in hybrid.plan.gpus)
    assert hybrid.iteration_s >= hybrid.bound_s * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_hybrid_never_slower_than_recompute_save_on_cpu_or_swap_only(make_profile, seed) -> None:
    import random

    rng = random.Random(seed)
    sizes = [
        tuple(rng.choice((0.5, 1, 2, 3)) for _ in range(rng.randint(1, 2)))
        for _ in range(rng.randint(3, 6))
    ]
    profile = make_profile(
        sizes,
        rng.uniform(0.02, 0.3),
        rng.uniform(0.04, 0.6),
        workspace_bytes=GB // 4,
        output_gb=rng.choice((0.0, 0.5)),
    )
    topology = preset(rng.choice(("switch-4", "dual-root-8")))
    common = dict(footprint_ratio=rng.uniform(1.1, 1.6), sync_every=rng.randint(1, 3))
    hybrid = make_plan(profile, topology, policy="hybrid", **common)
    assert hybrid.fits
    for policy in HEURISTICS + ("recompute", "save-on-cpu"):
        other = make_plan(profile, topology, policy=policy, **common)
        if other.fits:
            assert hybrid.iteration_s <= other.iteration_s + 1e-12, policy
    for gpu in hybrid.gpus:
        assert gpu.peak_bytes <= gpu.budget_bytes
