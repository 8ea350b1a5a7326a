"""make_plan: budgets, error messages, and that the exported graph reproduces the numbers.

Covers: pipeswap/swap/plan/planner.py.
"""

from __future__ import annotations

import re

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import TaskGraph
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.planner import make_plan
from pipeswap.swap.plan.workload import workload_from_profile

GB = 10**9


def test_budget_below_the_unswappable_minimum_names_the_smallest_that_works(make_profile) -> None:
    profile = make_profile([(4,), (2,), (3,)], workspace_bytes=GB)
    smallest = workload_from_profile(profile).min_budget_bytes()
    with pytest.raises(PipeswapError, match=f"smallest budget that works is {smallest} bytes"):
        make_plan(profile, preset("switch-4"), policy="disjoint", gpu_memory_bytes=smallest - 1)
    result = make_plan(profile, preset("switch-4"), policy="disjoint", gpu_memory_bytes=smallest)
    assert all(g.peak_bytes <= smallest for g in result.gpus)


def test_footprint_ratio_divides_the_no_swap_peak(make_profile) -> None:
    profile = make_profile([(4,), (2,), (3,)])
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    result = make_plan(profile, preset("switch-4"), policy="oblivious", footprint_ratio=1.5, gpus=1)
    assert result.budget_bytes == int(peak / 1.5)
    assert [g.gpu for g in result.gpus] == ["gpu0"]


def test_none_reports_the_failure_when_the_peak_does_not_fit(make_profile) -> None:
    result = make_plan(
        make_profile([(4,), (2,), (3,)]), preset("switch-4"), policy="none", footprint_ratio=1.5
    )
    assert not result.fits
    assert "does not fit" in result.notes["failure"]
    assert result.gpus[0].peak_bytes > result.budget_bytes


@pytest.mark.parametrize("policy", ["none", "recompute", "save-on-cpu"])
def test_a_run_refuses_a_baseline_that_does_not_fit_naming_the_budget_it_fits(
    make_profile, policy
) -> None:
    """A baseline plans by its rule; a run (``runnable``) refuses it where it does not fit,
    and the budget named is the least at which its plan fits and runs."""
    profile = make_profile([(4,), (2,), (3, 1)], 0.1, 0.2, output_gb=0.5)
    result = make_plan(profile, preset("switch-4"), policy=policy, footprint_ratio=3.0, gpus=2)
    assert not result.fits
    least = result.notes["least_bytes"]
    assert least > result.budget_bytes
    with pytest.raises(PipeswapError, match=f"the smallest budget that works is {least} bytes"):
        result.runnable()
    for budget, fits in ((least, True), (least - 1, False)):
        given = make_plan(profile, preset("switch-4"), policy=policy, gpu_memory_bytes=budget)
        assert given.fits is fits
    kept = make_plan(profile, preset("switch-4"), policy=policy, gpu_memory_bytes=least)
    assert kept.runnable() is kept
    assert all(g.peak_bytes <= least for g in kept.gpus)


@pytest.mark.parametrize(
    "policy",
    ["oblivious", "disjoint", "bidirectional", "recompute", "save-on-cpu", "hybrid", "mip", "auto"],
)
def test_exported_graph_reproduces_iteration_and_budget(make_profile, policy) -> None:
    profile = make_profile([(3, 1), (2,), (4, 2), (1,), (2, 2)], 0.1, 0.2, output_gb=0.5)
    result = make_plan(
        profile,
        preset("switch-4"),
        policy=policy,
        footprint_ratio=1.7,
        sync_every=2,
        time_limit_s=5,
    )
    graph = TaskGraph.from_json(result.graph.to_json())
    again = simulate(graph, preset("switch-4"), gpu_memory_bytes=result.budget_bytes)
    assert again.makespan_s == result.iteration_s
    assert all(s.peak_bytes <= result.budget_bytes for s in again.gpus.values())
    result.plan.validate(profile)
    assert result.plan.predicted_iteration_s == result.iteration_s
    # The plan's recomputed layers are the graph's re-run tasks.
    reruns = {
        t.id.split("/")[-1]
        for t in result.graph.tasks
        if re.fullmatch(r"r\d+", t.id.split("/")[-1])
    }
    assert reruns == {
        f"r{profile.layer_names.index(name)}" for g in result.plan.gpus for name in g.recompute
    }
    assert SwapPlan.from_json(result.plan.to_json()) == result.plan


def test_baselines_that_do_not_fit_say_so(make_profile) -> None:
    # Each layer keeps a 3 GB input for 3 GB of saved tensors: recomputing every block
    # frees nothing, so it cannot fit a budget below the no-swap peak.
    profile = make_profile([()] + [(3,)] * 4, 0.1, 0.2, output_gb=3)
    result = make_plan(profile, preset("switch-4"), policy="recompute", footprint_ratio=1.2, gpus=2)
    assert not result.fits
    assert "every block recomputed" in result.notes["failure"]
    assert result.gpus[0].recomputed_layers == 5
    hybrid = make_plan(profile, preset("switch-4"), policy="hybrid", footprint_ratio=1.2, gpus=2)
    assert hybrid.fits and not any(g.recompute for g in hybrid.plan.gpus)


def test_unknown_policy_and_gpu_count_are_refused(make_profile) -> None:
    profile = make_profile([(1,)] * 2)
    with pytest.raises(PipeswapError, match="use one of none, oblivious"):
        make_plan(profile, preset("switch-4"), policy="greedy", footprint_ratio=1.0)
    with pytest.raises(PipeswapError, match="use 1 to 4"):
        make_plan(profile, preset("switch-4"), policy="none", gpus=9, footprint_ratio=1.0)


def test_plan_reports_both_bounds_and_records_its_profile(make_profile) -> None:
    profile = make_profile([(6,)] * 6, 0.25, 0.5)
    result = make_plan(
        profile, preset("single-root-8"), policy="bidirectional", footprint_ratio=2.0
    )
    assert result.bound_s == max(result.lower_bound_s, result.turn_bound_s)
    assert result.turn_bound_s > result.lower_bound_s  # K=1: the turn bound is tighter here
    assert result.iteration_s >= result.bound_s
    payload = result.to_json()
    assert payload["turn_bound_s"] == result.turn_bound_s
    assert payload["gap_to_best_bound"] == pytest.approx(result.iteration_s / result.bound_s - 1)
    plan = result.plan
    assert (plan.model, plan.batch, plan.dtype) == ("toy", 1, "float32")
    assert plan.turn_bound_s == result.turn_bound_s
    # The offset was ranked on one switch's pair; the reported time is the full graph's.
    again = simulate(result.graph, preset("single-root-8"), gpu_memory_bytes=result.budget_bytes)
    assert again.makespan_s == result.iteration_s
    assert {g.offset_s for g in result.gpus} - {0.0}


@pytest.mark.parametrize("policy", ["auto", "mip", "hybrid"])
def test_the_smallest_budget_the_refusal_names_plans_with_the_searching_policies(
    make_profile, policy: str
) -> None:
    """Given back, the smallest budget plans: the swap-only heuristics that cannot reach it
    are left out of the search's start instead of ending it (found by the frontier run)."""
    profile = make_profile([(4,), (2,), (3, 1)], output_gb=1)
    smallest = workload_from_profile(profile).min_budget_bytes()
    result = make_plan(
        profile, preset("switch-4"), policy=policy, gpu_memory_bytes=smallest, time_limit_s=2
    )
    assert all(g.peak_bytes <= smallest for g in result.gpus)
