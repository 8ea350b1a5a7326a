"""The auto policy: local search that keeps every GPU within budget, from the MIP's answer.

Covers: pipeswap/swap/plan/auto.py.
"""

from __future__ import annotations

import time

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.auto import local_search
from pipeswap.swap.plan.channels import channel_groups
from pipeswap.swap.plan.planner import make_case, plan_case
from pipeswap.swap.plan.policies import HEURISTICS as POLICY_FUNCTIONS


def test_local_search_improves_a_poor_start_and_keeps_every_gpu_within_budget(
    make_profile,
) -> None:
    # Eight GPUs in four switch pairs; oblivious makes both GPUs of a pair swap the same
    # tensors at the same moments. The search ranks moves on one pair and hands the same
    # per-position plan to every pair.
    profile = make_profile([(3, 1), (2,), (4, 2), (1,), (2, 2), (1,)], 0.1, 0.2)
    case = make_case(profile, preset("single-root-8"), footprint_ratio=1.6, sync_every=2)
    start = POLICY_FUNCTIONS["oblivious"](case)
    refined, stats = local_search(case, start, deadline=time.perf_counter() + 1.5)
    assert refined is not None and stats["search_ranked_s"] < stats["search_start_ranked_s"]
    assert case.score(refined).iteration_s < case.score(start).iteration_s
    for gpu in case.gpus:  # the search may recompute layers too
        view = case.workload.recomputing(refined.recomputed(gpu))
        assert view.fits(refined.swaps[gpu], case.budget_bytes)
    pairs = channel_groups(case.topology, case.gpus)
    for pair in pairs[1:]:
        for position, gpu in enumerate(pair):
            assert refined.swaps[gpu] == refined.swaps[pairs[0][position]]
            assert refined.offsets_s.get(gpu) == refined.offsets_s.get(pairs[0][position])
            assert refined.recomputed(gpu) == refined.recomputed(pairs[0][position])
    result = case.score(refined).result
    assert all(s.peak_bytes <= case.budget_bytes for s in result.gpus.values())


def test_auto_reuses_the_mip_of_its_case(make_profile) -> None:
    profile = make_profile([(6,)] * 6, 0.25, 0.5)
    case = make_case(profile, preset("switch-4"), gpus=2, footprint_ratio=2.0, sync_every=2)
    mip = plan_case(case, profile, "mip", time_limit_s=2)
    auto = plan_case(case, profile, "auto", time_limit_s=2)
    assert auto.notes["mip_estimate_s"] == mip.notes["mip_estimate_s"]
    assert auto.iteration_s <= mip.iteration_s
    assert any(key.startswith("search_moves_tried") for key in auto.notes)
