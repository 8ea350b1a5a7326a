"""No plan beats either bound: heuristics, random and searched plans, with or without
recomputation, against design.md's link bound and the turn bound (the closed forms of each
term family are in tests/swap/plan/bounds/).

Covers: pipeswap/swap/plan/bounds/ (the package's two bounds).
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.auto import local_search
from pipeswap.swap.plan.bounds.link import lower_bound
from pipeswap.swap.plan.bounds.turn import turn_bound
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.planner import make_case
from pipeswap.swap.plan.policies import fits
from pipeswap.swap.plan.policy_table import POLICIES
from pipeswap.swap.plan.scoring import Assignment
from pipeswap.swap.plan.tensors import SwapDecisionAt
from pipeswap.swap.plan.workload import Workload, workload_from_profile

# Every policy that plans by rule (hybrid too), by name.
RULES = {name: p.assign for name, p in POLICIES.items() if p.assign is not None}

GB = 10**9
# Seeds of test_no_plan_beats_the_bounds_when_backward_points_differ: the first five beat
# the bound whose forwards waited for their backwards' bytes too.
SEEDS = [313, 327, 328, 360, 366, 300, 301, 302]


def _random_plan(rng: random.Random, w: Workload, budget: int) -> list[SwapDecisionAt]:
    """A random plan that fits: random tensors, swap-out and prefetch points."""
    n = w.num_layers
    tensors = [
        (layer, index, nbytes) for layer, saved in enumerate(w.swappable) for index, nbytes in saved
    ]
    rng.shuffle(tensors)
    chosen: list[SwapDecisionAt] = []
    for layer, index, nbytes in tensors:
        if w.fits(chosen, budget):
            break
        out = rng.randint(layer, max(layer, n - 2))
        chosen.append(SwapDecisionAt(layer, index, nbytes, out, rng.randint(layer + 1, n)))
    if not w.fits(chosen, budget):
        # Everything swapped, out at once and back just in time, always fits.
        chosen = [SwapDecisionAt(s.layer, s.index, s.bytes, s.layer, s.layer + 1) for s in chosen]
    assert w.fits(chosen, budget)
    return chosen


def _can_fit(w: Workload, budget: int) -> bool:
    everything = [
        SwapDecisionAt(layer, index, nbytes, layer, layer + 1)
        for layer, saved in enumerate(w.swappable)
        for index, nbytes in saved
    ]
    return w.fits(everything, budget)


@pytest.mark.parametrize("seed", range(30))
def test_no_plan_beats_either_bound(make_profile, seed) -> None:
    rng = random.Random(seed)
    sizes = [
        tuple(rng.choice((0.5, 1, 2, 3)) for _ in range(rng.randint(1, 2)))
        for _ in range(rng.randint(3, 6))
    ]
    # Outputs of 0.5 or 1 GB: some layers save their input (kept once), some do not.
    profile = make_profile(
        sizes,
        rng.uniform(0.02, 0.3),
        rng.uniform(0.04, 0.6),
        param_bytes=rng.choice((0, GB // 10)),
        workspace_bytes=GB // 4,
        output_gb=rng.choice((0.0, 0.5, 1.0)),
    )
    gpus = rng.randint(1, 4)
    sync_every = rng.randint(1, 3)
    ratio = rng.uniform(1.1, 2.0)
    try:
        case = make_case(
            profile,
            preset("switch-4"),
            gpus=gpus,
            footprint_ratio=ratio,
            sync_every=sync_every,
            bucket_bytes=GB // 8,
        )
    except PipeswapError:
        case = make_case(
            profile,
            preset("switch-4"),
            gpus=gpus,
            footprint_ratio=1.05,
            sync_every=sync_every,
            bucket_bytes=GB // 8,
        )
    design = lower_bound(
        case.workload, case.topology, case.gpus, case.budget_bytes, sync_every=sync_every
    )
    turn = turn_bound(
        case.workload,
        case.topology,
        case.gpus,
        case.budget_bytes,
        sync_every=sync_every,
        bucket_bytes=case.bucket_bytes,
    )
    times = {
        name: case.score(plan(case)).iteration_s
        for name, plan in RULES.items()
        if name != "none" and fits(case, plan(case))
    }
    for trial in range(4):  # random plans with random offsets, not only the heuristics'
        # Half of them recompute random layers (each GPU its own), and swap on top.
        layers = {
            g: frozenset(
                i for i in range(case.workload.num_layers) if trial % 2 and rng.random() < 0.4
            )
            for g in case.gpus
        }
        layers = {
            g: r if _can_fit(case.workload.recomputing(r), case.budget_bytes) else frozenset()
            for g, r in layers.items()
        }
        swaps = {
            g: tuple(_random_plan(rng, case.workload.recomputing(layers[g]), case.budget_bytes))
            for g in case.gpus
        }
        offsets = {g: rng.choice((0.0, rng.uniform(0, 1))) for g in case.gpus}
        times[f"random{trial}"] = case.score(Assignment(swaps, offsets, layers)).iteration_s
    for name, seconds in times.items():
        assert seconds >= design.bound_s * (1 - 1e-9), (name, seconds, design)
        assert seconds >= turn.bound_s * (1 - 1e-9), (name, seconds, turn)


@pytest.mark.parametrize("seed", range(6))
def test_local_search_never_beats_either_bound(make_profile, seed) -> None:
    # Adversarial plans: the auto policy's local search drives random small cases as low
    # as it can (offsets, points, tensors); the bounds must still hold.
    rng = random.Random(100 + seed)
    sizes = [
        tuple(rng.choice((0.5, 1, 2, 3)) for _ in range(rng.randint(1, 2)))
        for _ in range(rng.randint(3, 6))
    ]
    profile = make_profile(
        sizes,
        rng.uniform(0.02, 0.3),
        rng.uniform(0.04, 0.6),
        param_bytes=rng.choice((0, GB // 10)),
        workspace_bytes=GB // 4,
        output_gb=rng.choice((0.0, 0.5)),
    )
    topology = preset(rng.choice(("switch-4", "dual-root-8")), copy_engines=rng.choice((1, 2)))
    sync_every = rng.randint(1, 3)
    try:
        case = make_case(
            profile,
            topology,
            gpus=rng.choice((2, 4)),
            footprint_ratio=rng.uniform(1.2, 2.0),
            sync_every=sync_every,
        )
    except PipeswapError:
        case = make_case(profile, topology, gpus=2, footprint_ratio=1.1, sync_every=sync_every)
    bound = max(
        lower_bound(
            case.workload, case.topology, case.gpus, case.budget_bytes, sync_every=sync_every
        ).bound_s,
        turn_bound(
            case.workload,
            case.topology,
            case.gpus,
            case.budget_bytes,
            sync_every=sync_every,
            bucket_bytes=case.bucket_bytes,
        ).bound_s,
    )
    for name in ("bidirectional", "hybrid"):  # hybrid's starts recompute layers
        start = RULES[name](case)
        refined, _ = local_search(case, start, deadline=time.perf_counter() + 0.3, seed=seed)
        for plan in (start, refined or start):
            assert case.score(plan).iteration_s >= bound * (1 - 1e-9), name


# ---- with recomputation -----------------------------------------------------------------


@pytest.mark.parametrize("sync_every", [1, 2])
def test_no_mix_of_recompute_sets_beats_the_bounds(make_profile, sync_every) -> None:
    # Every pair of recompute sets on two GPUs sharing a link (one may recompute nothing
    # while the other recomputes all), each with random swaps and offsets.
    rng = random.Random(sync_every)
    profile = make_profile([(6,), (3, 2), (6,), (2,)], 0.05, 0.11, param_bytes=0, output_gb=0.5)
    case = make_case(
        profile, preset("switch-4"), gpus=2, footprint_ratio=1.8, sync_every=sync_every
    )
    bound = max(
        lower_bound(
            case.workload, case.topology, case.gpus, case.budget_bytes, sync_every=sync_every
        ).bound_s,
        turn_bound(
            case.workload,
            case.topology,
            case.gpus,
            case.budget_bytes,
            sync_every=sync_every,
            bucket_bytes=case.bucket_bytes,
        ).bound_s,
    )
    n = case.workload.num_layers
    subsets = [frozenset(i for i in range(n) if mask >> i & 1) for mask in range(1 << n)]
    subsets = [r for r in subsets if _can_fit(case.workload.recomputing(r), case.budget_bytes)]
    for first in subsets:
        for second in subsets:
            layers = dict(zip(case.gpus, (first, second)))
            swaps = {
                g: tuple(_random_plan(rng, case.workload.recomputing(layers[g]), case.budget_bytes))
                for g in case.gpus
            }
            offsets = {g: rng.choice((0.0, rng.uniform(0, 0.2))) for g in case.gpus}
            seconds = case.score(Assignment(swaps, offsets, layers)).iteration_s
            assert seconds >= bound * (1 - 1e-9), (first, second, seconds, bound)


# ---- measured memory: forward and backward points differ --------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_no_plan_beats_the_bounds_when_backward_points_differ(make_profile, seed) -> None:
    # A measured profile's backward working sets (gradients made so far) and its turn are
    # not its forwards' (tests/swap/plan/bounds/test_measured.py has a real one): a
    # forward may need fewer bytes off the GPU than its backward, or more.
    rng = random.Random(seed)
    sizes = [
        tuple(rng.choice((0.5, 1, 2, 3)) for _ in range(rng.randint(1, 2)))
        for _ in range(rng.randint(3, 6))
    ]
    w = workload_from_profile(
        make_profile(
            sizes,
            rng.uniform(0.02, 0.3),
            rng.uniform(0.04, 0.6),
            param_bytes=rng.choice((0, GB // 10)),
            workspace_bytes=GB // 4,
            output_gb=rng.choice((0.0, 0.5, 1.0)),
        )
    )
    n = w.num_layers
    w = replace(
        w,
        transient=tuple(rng.choice((0, GB // 4, GB, 2 * GB)) for _ in range(n)),
        backward_transient=tuple(rng.choice((0, GB // 4, GB, 3 * GB)) for _ in range(n)),
        turn_bytes=rng.choice((0, GB, 3 * GB)),
    )
    least, peak = w.min_budget_bytes(recomputing=False), w.no_swap_peak_bytes()
    budget = int(rng.uniform(least, peak))
    topology = preset("switch-4")
    gpus = tuple(f"gpu{i}" for i in range(rng.choice((1, 2, 4))))
    sync_every = rng.randint(1, 3)
    case = Case(w, topology.with_gpu_memory(budget), gpus, budget, sync_every, GB // 8)

    def bound(recompute: bool) -> float:
        return max(
            lower_bound(w, topology, gpus, budget, sync_every=sync_every).bound_s,
            turn_bound(
                w,
                topology,
                gpus,
                budget,
                sync_every=sync_every,
                bucket_bytes=GB // 8,
                recompute=recompute,
            ).bound_s,
        )

    plans = {name: plan(case) for name, plan in RULES.items() if name != "none"}
    plans = {name: plan for name, plan in plans.items() if fits(case, plan)}
    for trial in range(4):
        swaps = {g: tuple(_random_plan(rng, w, budget)) for g in gpus}
        offsets = {g: rng.choice((0.0, rng.uniform(0, 0.2))) for g in gpus}
        plans[f"random{trial}"] = Assignment(swaps, offsets)
    for name in ("bidirectional", "disjoint"):
        if name in plans:
            refined, _ = local_search(
                case, plans[name], deadline=time.perf_counter() + 0.2, seed=seed
            )
            plans[f"searched {name}"] = refined or plans[name]
    for name, plan in plans.items():
        seconds = case.score(plan).iteration_s
        assert seconds >= bound(any(plan.recompute.values())) * (1 - 1e-9), (name, seconds)
