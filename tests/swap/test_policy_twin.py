"""The swap policies: a new policy is one entry plus its algorithm, and every place asks them.

A copy of each policy under a new name (its PolicyKind in pipeswap.swap.swap_config.POLICY_KINDS,
its algorithm in pipeswap.swap.plan.policy_table.POLICIES), registered for one test, goes
through every place that must know a policy (the config, the data-parallel planner and
its budget check, `pipeswap plan --compare`, the stage plans of a pipeline that swaps)
and behaves exactly as the policy it copies. A policy missing either half is refused
naming the missing piece, never a KeyError.

Covers: pipeswap/swap/swap_config.py (POLICY_KINDS), pipeswap/swap/plan/policy_table.py
(policy_entry), the policy's stage moves in pipeswap/training/pipeline_stage_swaps.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
from support import pipeline_run, toy_profile

from pipeswap.commands.plan import compare
from pipeswap.config_fields import ConfigError
from pipeswap.hardware.presets import preset
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.profiling.profile import Profile
from pipeswap.swap.plan.planner import PlanResult, make_case, make_plan, plan_case
from pipeswap.swap.plan.policy_table import POLICIES, policy_entry
from pipeswap.swap.swap_config import POLICY_KINDS, PolicyKind, StageMoves, SwapConfig, policy_kind
from pipeswap.train_config import TrainConfig
from pipeswap.training.pipeline_stage_swaps import micro_profile, plan_stage_swaps

TWIN = "twin-policy"


@pytest.fixture(params=list(POLICY_KINDS))
def twin(request: pytest.FixtureRequest) -> Iterator[str]:
    """A policy's name, with its copy declared and given its algorithm for the test only."""
    name = request.param
    POLICY_KINDS[TWIN] = dataclasses.replace(POLICY_KINDS[name], name=TWIN)
    POLICIES[TWIN] = dataclasses.replace(POLICIES[name], name=TWIN)
    try:
        yield name
    finally:
        del POLICY_KINDS[TWIN], POLICIES[TWIN]


def _profile() -> Profile:
    return toy_profile([(2,), (3,), (2,), (1,)])


def _plan(result: PlanResult) -> tuple[Any, ...]:
    """What a plan decides and how it scores, its policy's name left out."""
    return result.fits, result.iteration_s, result.plan.gpus, [g.peak_bytes for g in result.gpus]


def _pipeline() -> TrainConfig:
    """gpt2-tiny cut into 2 stages, 8 samples a step in 4 micro-batches."""
    given = {"seq_len": 32, "steps": 2, "lr": 0.05, "device": "cpu"}
    config = pipeline_run("gpt2-tiny", (3, 3), batch=8, micro_batches=4, **given)
    return resolve_pipeline(replace(config, progress=False).resolved())


@cache
def _micro_profile() -> Profile:
    return micro_profile(_pipeline())


def _stage_plans(policy: str) -> Any:
    """The stage plans of the pipeline under ``policy`` (its name left out), or the refusal."""
    config = replace(_pipeline(), swap=SwapConfig(policy=policy, footprint_ratio=1.3))
    try:
        plans = plan_stage_swaps(config, _micro_profile())
    except ConfigError as error:
        return error.message.replace(policy, "P")
    if plans is None:
        return None
    return plans.plans, plans.budget_bytes, plans.placement, plans.recompute_allowed


def test_a_copy_of_a_policy_is_one_entry_plus_its_algorithm_and_runs_as_it(twin: str) -> None:
    # The config takes it.
    assert SwapConfig(policy=TWIN).policy == TWIN and policy_kind(TWIN).name == TWIN
    # The planner: the budget check and the plan, the same as the policy it copies.
    case = make_case(_profile(), preset("switch-4"), gpus=2, footprint_ratio=1.3)
    mine = plan_case(case, _profile(), TWIN, time_limit_s=2)
    theirs = plan_case(case, _profile(), twin, time_limit_s=2)
    assert mine.policy == TWIN and _plan(mine) == _plan(theirs)
    for ratio in (1.3, 50.0):  # a budget it plans for, and one below what any plan reaches
        outcomes = []
        for name in (TWIN, twin):
            try:
                result = make_plan(
                    _profile(), preset("switch-4"), policy=name, gpus=2, footprint_ratio=ratio
                )
                outcomes.append(_plan(result))
            except ConfigError as error:
                outcomes.append(error.message.replace(f"policy {name} ", "policy P "))
        assert outcomes[0] == outcomes[1]
    # A pipeline's stages: the same plans (or the same refusal) as the policy it copies.
    assert _stage_plans(TWIN) == _stage_plans(twin)


def test_plan_compare_plans_a_registered_copy_too() -> None:
    POLICY_KINDS[TWIN] = dataclasses.replace(POLICY_KINDS["disjoint"], name=TWIN)
    POLICIES[TWIN] = dataclasses.replace(POLICIES["disjoint"], name=TWIN)
    try:
        case = make_case(_profile(), preset("switch-4"), gpus=2, footprint_ratio=1.3)
        results = {r.policy: r for r in compare(case, _profile(), time_limit_s=1)[0]}
    finally:
        del POLICY_KINDS[TWIN], POLICIES[TWIN]
    assert list(results) == [*POLICY_KINDS, TWIN]
    assert _plan(results[TWIN]) == _plan(results["disjoint"])


def test_a_policy_missing_a_half_is_refused_naming_what_is_missing() -> None:
    assert TWIN not in POLICY_KINDS and TWIN not in POLICIES
    # An algorithm with no declaration: the config names the valid policies.
    POLICIES[TWIN] = dataclasses.replace(POLICIES["disjoint"], name=TWIN)
    try:
        with pytest.raises(ConfigError, match=f"'{TWIN}' is not a swap policy; use one of none"):
            SwapConfig(policy=TWIN)
    finally:
        del POLICIES[TWIN]
    # A declaration with no algorithm: the planner says where to add it.
    POLICY_KINDS[TWIN] = PolicyKind(TWIN, StageMoves(swap=True))
    try:
        SwapConfig(policy=TWIN)
        with pytest.raises(ConfigError, match="has no algorithm: add its entry to POLICIES"):
            make_plan(_profile(), preset("switch-4"), policy=TWIN, gpus=2, footprint_ratio=1.3)
        with pytest.raises(ConfigError, match="has no algorithm"):
            policy_entry(TWIN)
    finally:
        del POLICY_KINDS[TWIN]
    # A declaration whose stages do nothing for pipelines (stages None), as mip's: refused.
    POLICY_KINDS[TWIN] = PolicyKind(TWIN, None)
    try:
        refusal = _stage_plans(TWIN)
        assert isinstance(refusal, str) and refusal.startswith("{policy} P plans data-parallel")
        assert "auto" in refusal and "mip" not in refusal
    finally:
        del POLICY_KINDS[TWIN]


@pytest.mark.parametrize("name", list(POLICY_KINDS))
def test_every_declared_policy_has_its_algorithm_and_they_agree(name: str) -> None:
    kind, entry = policy_kind(name), policy_entry(name)
    assert kind.name == entry.name == name
    # A policy whose stages recompute is one whose data-parallel plans may recompute.
    if kind.stages is not None:
        assert kind.stages.recompute == entry.recomputes
        assert not (kind.stages.every_layer and (kind.stages.swap or kind.stages.recompute))


def test_the_declarations_and_the_algorithms_are_one_set_in_one_order() -> None:
    assert tuple(POLICIES) == tuple(POLICY_KINDS)
