"""pipeswap/swap/plan/finer.py (and Workload.selecting): per layer kept, recomputed
selectively or whole, for the least recomputation time that fits, in closed form."""

from __future__ import annotations

import dataclasses
import time

import pytest
from support import GB, toy_profile

from pipeswap.config_fields import ConfigError
from pipeswap.hardware.presets import preset
from pipeswap.profiling.profile import Profile
from pipeswap.swap.plan import GpuPlan
from pipeswap.swap.plan.auto import local_search
from pipeswap.swap.plan.finer import plan_finer, view
from pipeswap.swap.plan.hybrid import hybrid
from pipeswap.swap.plan.planner import make_case, make_plan
from pipeswap.swap.plan.policies import fits
from pipeswap.swap.plan.workload import workload_from_profile

FORWARD_S = 0.0625
SELECTIVE_S = FORWARD_S / 8  # the cheap operations' share of the forward


def _profile() -> Profile:
    """Four layers saving 6 GB each (input 0.5 GB); recomputed selectively a layer keeps
    3 GB (its input and its matmuls' outputs) and re-runs an eighth of its forward."""
    profile = toy_profile([(6,)] * 4, FORWARD_S, 2 * FORWARD_S, param_bytes=0, output_gb=0.5)
    layers = tuple(
        dataclasses.replace(
            layer,
            selective_kept_bytes=3 * GB,
            selective_rerun_bytes=3 * GB,
            selective_rerun_s=SELECTIVE_S,
        )
        for layer in profile.layers
    )
    return dataclasses.replace(profile, layers=layers)


def test_a_selective_view_keeps_more_and_reruns_less() -> None:
    w = workload_from_profile(_profile())
    assert w.can_select
    whole = w.recomputing({1})
    chosen = w.selecting({1}).recomputing({1})
    assert (whole.saved_bytes[1], chosen.saved_bytes[1]) == (GB // 2, 3 * GB)
    # Whole, the re-run saves all 6 GB again (the input is no saved tensor of its own).
    assert (whole.recompute_bytes[1], chosen.recompute_bytes[1]) == (6 * GB, 3 * GB)
    assert (whole.recompute_s, chosen.recompute_s) == (FORWARD_S, SELECTIVE_S)
    # A selection changes nothing for a layer that is not recomputed.
    assert w.selecting({1}).saved_bytes == w.saved_bytes
    assert w.selecting({1}) is w.selecting({1})  # views are built once


def test_finer_choices_fit_the_same_budget_with_less_recomputation() -> None:
    profile = _profile()
    topology = preset("switch-4")
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    for freed_gb in (3, 6, 9, 12):
        case = make_case(profile, topology, gpus=1, gpu_memory_bytes=peak - freed_gb * GB)
        finer = plan_finer(case)
        whole = plan_finer(case, selective=False)
        assert finer is not None and whole is not None
        assert fits(case, finer) and fits(case, whole), freed_gb
        gpu = case.gpus[0]
        finer_s = view(case.workload, _state(finer.recomputed(gpu), finer.selective)).recompute_s
        whole_s = case.workload.recomputing(whole.recomputed(gpu)).recompute_s
        assert not whole.selective
        # Freeing 3k GB whole takes k layers' forwards; selectively, k layers an eighth each.
        assert finer_s < whole_s, (freed_gb, finer_s, whole_s)
        assert case.score(finer).iteration_s < case.score(whole).iteration_s


def _state(recompute: frozenset[int], selective: frozenset[int]) -> dict[int, str]:
    return {
        i: "selective" if i in selective else "whole" if i in recompute else "kept"
        for i in range(4)
    }


def test_nothing_is_recomputed_when_everything_fits_and_none_fits_below_whole_blocks() -> None:
    profile = _profile()
    topology = preset("switch-4")
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    roomy = plan_finer(make_case(profile, topology, gpus=1, gpu_memory_bytes=peak))
    assert roomy is not None and not roomy.recomputed("gpu0") and not roomy.selective
    least = workload_from_profile(profile).recomputing(range(4))
    below = least.no_swap_peak_bytes() - 1
    tight = make_case(profile, topology, gpus=1, gpu_memory_bytes=max(below, 1))
    assert plan_finer(tight) is None


def test_without_a_measured_selection_only_whole_blocks_are_chosen() -> None:
    profile = toy_profile([(6,)] * 4, FORWARD_S, 2 * FORWARD_S, param_bytes=0, output_gb=0.5)
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    case = make_case(profile, preset("switch-4"), gpus=1, gpu_memory_bytes=peak - 6 * GB)
    plan = plan_finer(case)
    assert plan is not None and not plan.selective and plan.recomputed(case.gpus[0])


def test_hybrid_is_never_slower_than_the_finer_plan() -> None:
    profile = _profile()
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    case = make_case(profile, preset("switch-4"), gpus=2, gpu_memory_bytes=peak - 6 * GB)
    finer = plan_finer(case)
    assert finer is not None
    assert case.score(hybrid(case)).iteration_s <= case.score(finer).iteration_s + 1e-12


def test_whole_blocks_only_when_the_config_says_so() -> None:
    profile = _profile()
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    settings = {"gpus": 1, "gpu_memory_bytes": peak - 6 * GB}
    finer = plan_finer(make_case(profile, preset("switch-4"), **settings))
    whole = plan_finer(make_case(profile, preset("switch-4"), whole_blocks=True, **settings))
    assert finer is not None and finer.selective
    assert whole is not None and not whole.selective and whole.recomputed("gpu0")


def test_policy_finer_writes_its_choice_into_the_plan_and_names_its_smallest_budget() -> None:
    profile = _profile()
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    result = make_plan(
        profile, preset("switch-4"), gpus=1, policy="finer", gpu_memory_bytes=peak - 6 * GB
    )
    gpu = result.plan.gpus[0]
    assert gpu.selective and set(gpu.selective) <= set(gpu.recompute) and not gpu.swaps
    assert GpuPlan.from_json(gpu.to_json()) == gpu  # the choice survives the plan's JSON
    least = workload_from_profile(profile).recomputing(range(4)).no_swap_peak_bytes()
    with pytest.raises(ConfigError, match=f"the smallest budget that works is {least} bytes"):
        make_plan(profile, preset("switch-4"), gpus=1, policy="finer", gpu_memory_bytes=least - 1)


def test_local_search_keeps_the_selective_layers_of_its_start() -> None:
    profile = _profile()
    peak = workload_from_profile(profile).no_swap_peak_bytes()
    case = make_case(profile, preset("switch-4"), gpus=2, gpu_memory_bytes=peak - 6 * GB)
    start = plan_finer(case)
    assert start is not None and start.selective
    refined, _ = local_search(case, start, deadline=time.perf_counter() + 0.5)
    if refined is not None:  # better as simulated with the same layers selective
        assert refined.selective == start.selective and fits(case, refined)
        assert case.score(refined).iteration_s < case.score(start).iteration_s
