"""pipeswap/swap/plan/policy_table.py: every policy one entry, and the planner asks the entry."""

from __future__ import annotations

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.planner import make_case, plan_case
from pipeswap.swap.plan.policy_table import POLICIES
from pipeswap.swap.swap_config import POLICY_NAMES


def test_the_table_is_the_configs_choices() -> None:
    assert tuple(POLICIES) == POLICY_NAMES
    baselines = {name for name, p in POLICIES.items() if not p.respects_budget}
    assert baselines == {"none", "recompute", "save-on-cpu"}
    assert all(POLICIES[name].peak for name in baselines)


def test_every_entry_plans_through_the_planner(make_profile) -> None:
    profile = make_profile([(2,), (3,), (2,), (1,)])
    case = make_case(profile, preset("switch-4"), gpus=2, footprint_ratio=1.3)
    for name, policy in POLICIES.items():
        result = plan_case(case, profile, name, time_limit_s=2)
        assert result.policy == name and result.iteration_s > 0
        if policy.respects_budget:
            assert result.fits, name
            assert all(g.peak_bytes <= case.budget_bytes for g in result.gpus), name
