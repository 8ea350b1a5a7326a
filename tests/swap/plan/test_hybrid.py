"""pipeswap/swap/plan/hybrid.py: nested recompute ladders, and never slower than the rules."""

from __future__ import annotations

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.hybrid import hybrid, recompute_ladder
from pipeswap.swap.plan.planner import make_case
from pipeswap.swap.plan.policies import SWAP_ONLY, fits, heuristic


def test_the_ladder_is_nested_and_ends_where_recomputation_alone_fits(make_profile) -> None:
    profile = make_profile([(2,), (3,), (2,), (4,), (1,)], output_gb=0.25)
    case = make_case(profile, preset("switch-4"), gpus=1, footprint_ratio=1.5)
    ladder = recompute_ladder(case.workload, case.budget_bytes)
    assert ladder and all(a < b for a, b in zip(ladder, ladder[1:]))  # each a strict superset


def test_hybrid_is_never_slower_than_a_rule_that_fits(make_profile) -> None:
    profile = make_profile([(2,), (3,), (2,), (4,), (1,)], output_gb=0.25)
    case = make_case(profile, preset("switch-4"), gpus=2, footprint_ratio=1.5)
    plan = hybrid(case)
    assert fits(case, plan) and hybrid(case) is plan  # remembered per case
    best = case.score(plan).iteration_s
    for name in (*SWAP_ONLY, "recompute", "save-on-cpu"):
        rule = heuristic(case, name)
        if fits(case, rule):
            assert best <= case.score(rule).iteration_s + 1e-12, name
