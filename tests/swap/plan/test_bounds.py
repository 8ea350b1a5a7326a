"""The lower bounds: design.md's link bound and the turn bound, closed form and by property,
for plans that only swap (``recompute=False``) and for plans that also recompute.

Covers: pipeswap/swap/plan/bounds/ (link, turn, sharing, recursion, relief, inputs).
"""

from __future__ import annotations

import random
import time

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.auto import local_search
from pipeswap.swap.plan.bounds.inputs import BoundInputs
from pipeswap.swap.plan.bounds.link import lower_bound
from pipeswap.swap.plan.bounds.recursion import shortest_microbatch_s
from pipeswap.swap.plan.bounds.relief import Relief
from pipeswap.swap.plan.bounds.sharing import channel_terms
from pipeswap.swap.plan.bounds.turn import _turn_bound, turn_bound
from pipeswap.swap.plan.planner import make_case
from pipeswap.swap.plan.policies import fits
from pipeswap.swap.plan.policy_table import POLICIES
from pipeswap.swap.plan.scoring import Assignment
from pipeswap.swap.plan.workload import Swap, Workload, workload_from_profile

# Every policy that plans by rule (hybrid too), by name.
RULES = {name: p.assign for name, p in POLICIES.items() if p.assign is not None}

GB = 10**9


def test_compute_bound_when_nothing_must_move(make_profile) -> None:
    w = workload_from_profile(make_profile([(6,)] * 4, param_bytes=0))
    bound = lower_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], 10**12, sync_every=2, recompute=False
    )
    assert bound.binding == "compute"
    assert bound.bound_s == pytest.approx(2 * 4 * 3.0)
    assert bound.min_swap_bytes == 0


def test_shared_uplink_bound(make_profile) -> None:
    # 4 layers of 6 GB, compute 0.75 s per micro-batch; budget leaves 12 GB to move each way.
    w = workload_from_profile(make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0))
    budget = w.no_swap_peak_bytes() - 12 * GB
    bound = lower_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=1, recompute=False
    )
    # Two GPUs behind sw0 push 2 * 12 GB through the 12 GB/s uplink: 2 s each direction.
    assert bound.link_s["sw0->cpu0"] == pytest.approx(2.0)
    assert bound.link_s["cpu0->sw0"] == pytest.approx(2.0)
    assert bound.link_s["gpu0->sw0"] == pytest.approx(1.0)
    assert bound.bound_s == pytest.approx(2.0)
    assert bound.binding in ("sw0->cpu0", "cpu0->sw0")


# ---- the turn bound ------------------------------------------------------------------------
def _four_layers(make_profile):
    # Saved 6 GB per layer, forward 1/16 s, backward 1/8 s, no weights: peak 24 GB.
    w = workload_from_profile(make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0))
    return w, w.no_swap_peak_bytes() - 12 * GB  # 12 GB must leave (D / B = 1 s)


def test_turn_bound_one_gpu_closed_form(make_profile) -> None:
    w, budget = _four_layers(make_profile)
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


def test_turn_bound_shared_uplink_closed_form(make_profile) -> None:
    w, budget = _four_layers(make_profile)
    bound = turn_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=1, recompute=False
    )
    # 2 x 12 GB leave through sw0's uplink after forward 0 (1/16 s) and before forward 3
    # of the last GPU, which still has 1/16 + 1/2 s to run: 1/16 + 2 + 9/16.
    assert bound.channel_s["sw0<->cpu0 swap-outs"] == pytest.approx(2.625)
    # Back: after the turn (1/4 s) and before backward 0 (1/8 s): 1/4 + 2 + 1/8.
    assert bound.channel_s["sw0<->cpu0 prefetches"] == pytest.approx(2.375)
    design = lower_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], budget, sync_every=1, recompute=False
    )
    assert design.bound_s == pytest.approx(2.0)


def test_sharing_terms_closed_form(make_profile) -> None:
    w, budget = _four_layers(make_profile)
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


def test_turn_bound_is_compute_when_nothing_must_move(make_profile) -> None:
    w = workload_from_profile(make_profile([(6,)] * 4, param_bytes=0))
    bound = turn_bound(
        w, preset("switch-4"), ["gpu0", "gpu1"], 10**12, sync_every=2, recompute=False
    )
    assert bound.bound_s == pytest.approx(w.compute_s(2))
    assert bound.channel_s == {}


def _random_plan(rng: random.Random, w: Workload, budget: int) -> list[Swap]:
    """A random plan that fits: random tensors, swap-out and prefetch points."""
    n = w.num_layers
    tensors = [
        (layer, index, nbytes) for layer, saved in enumerate(w.swappable) for index, nbytes in saved
    ]
    rng.shuffle(tensors)
    chosen: list[Swap] = []
    for layer, index, nbytes in tensors:
        if w.fits(chosen, budget):
            break
        out = rng.randint(layer, max(layer, n - 2))
        chosen.append(Swap(layer, index, nbytes, out, rng.randint(layer + 1, n)))
    if not w.fits(chosen, budget):
        # Everything swapped, out at once and back just in time, always fits.
        chosen = [Swap(s.layer, s.index, s.bytes, s.layer, s.layer + 1) for s in chosen]
    assert w.fits(chosen, budget)
    return chosen


def _can_fit(w: Workload, budget: int) -> bool:
    everything = [
        Swap(layer, index, nbytes, layer, layer + 1)
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


@pytest.mark.parametrize("sync_every, expected", [(1, 3.375), (3, 8.125)])
def test_bidirectional_reaches_the_sharing_bound(make_profile, sync_every, expected) -> None:
    # The closed form above is attained: the late GPU starts once the early one's 12 GB
    # are out, and pays that once per sync; nothing faster exists, and bidirectional finds it.
    w, budget = _four_layers(make_profile)
    profile = make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0)
    case = make_case(
        profile, preset("switch-4"), gpus=2, gpu_memory_bytes=budget, sync_every=sync_every
    )
    bound = turn_bound(w, case.topology, case.gpus, budget, sync_every=sync_every, recompute=False)
    assert bound.bound_s == pytest.approx(expected)
    plan = RULES["bidirectional"](case)
    assert case.score(plan).iteration_s == pytest.approx(expected)


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
def test_link_bound_with_recompute_closed_form(make_profile) -> None:
    # One GPU, 4 layers of 6 GB, forward 1/16 s each (96 GB freed per recompute second),
    # 12 GB must go: recomputing T seconds leaves 12 - 96 T GB for the 12 GB/s link
    # (1 - 8 T s) and adds T to the 0.75 s of compute; they cross at T = 1/36.
    w, budget = _four_layers(make_profile)
    swap_only = lower_bound(w, preset("switch-4"), ["gpu0"], budget, recompute=False)
    assert swap_only.bound_s == pytest.approx(1.0)
    bound = lower_bound(w, preset("switch-4"), ["gpu0"], budget)
    assert bound.bound_s == pytest.approx(0.75 + 1 / 36, rel=1e-6)
    assert bound.bound_s <= 0.75 + 1 / 36 + 1e-12  # never above the true minimum
    assert bound.recompute_s == pytest.approx(1 / 36, rel=1e-4)


def test_turn_bound_with_recompute_is_below_swap_only_and_above_compute(make_profile) -> None:
    w, budget = _four_layers(make_profile)
    swap_only = turn_bound(w, preset("switch-4"), ["gpu0", "gpu1"], budget, recompute=False)
    both = turn_bound(w, preset("switch-4"), ["gpu0", "gpu1"], budget)
    assert w.compute_s(1) < both.bound_s < swap_only.bound_s
    # Recomputing everything costs 1/4 s and moves nothing: no bound may exceed that.
    assert both.bound_s <= w.compute_s(1) + 0.25 + 1e-9
    everything = Assignment(
        {g: () for g in ("gpu0", "gpu1")},
        recompute={g: frozenset(range(4)) for g in ("gpu0", "gpu1")},
    )
    case = make_case(
        make_profile([(6,)] * 4, 0.0625, 0.125, param_bytes=0),
        preset("switch-4"),
        gpus=2,
        gpu_memory_bytes=budget,
    )
    assert case.score(everything).iteration_s == pytest.approx(1.0)
    assert case.score(everything).iteration_s >= both.bound_s


def test_nothing_worth_recomputing_keeps_the_swap_only_bounds(make_profile) -> None:
    # Each layer keeps a 6 GB input for 6 GB of saved tensors (layer 0 saves nothing):
    # recomputing frees nothing.
    w = workload_from_profile(
        make_profile([()] + [(6,)] * 3, 0.0625, 0.125, param_bytes=0, output_gb=6)
    )
    budget = w.no_swap_peak_bytes() - 6 * GB
    assert all(freed <= 0 for freed in w.freed_bytes)
    assert (
        turn_bound(w, preset("switch-4"), ["gpu0"], budget).bound_s
        == turn_bound(w, preset("switch-4"), ["gpu0"], budget, recompute=False).bound_s
    )


def test_shared_uplink_with_recompute_closed_form(make_profile) -> None:
    # Two GPUs behind sw0 (12 GB/s) must each free 12 GB before forward 3; recomputing s
    # seconds frees at most 96 s GB (6 GB per 1/16 s). With both recomputing at most T,
    # the GPU that recomputes least (s) leaves 12 - 96 s GB, the other 12 - 96 T, and the
    # later GPU still re-runs s seconds after its forward 3: 1/16 + (24 - 96 (T + s)) / 12
    # + 9/16 + s, least at s = T: 2.625 - 15 T (not 2.625 - 16 T: the re-run is counted).
    w, budget = _four_layers(make_profile)
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


def test_relief_slope_bounds_less_recomputation(make_profile) -> None:
    # The knapsack is concave in the seconds: its slope at T bounds every s <= T.
    w = workload_from_profile(
        make_profile([(6,), (2,), (3, 1), (0.5,)], 0.05, 0.1, param_bytes=0, output_gb=0.5)
    )
    for seconds in (0.01, 0.04, 0.07, 0.12, 0.2):
        relief = Relief(w, seconds)
        for s in (0.0, seconds / 3, seconds / 2, seconds):
            less = Relief(w, s)
            for k in range(w.num_layers):
                for i in range(k, w.num_layers):
                    ceiling = relief.between(k, i) - relief.slope(k, i) * (seconds - s)
                    assert less.between(k, i) <= ceiling + 1e-3


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
