"""The partitioner is exact: it matches brute force over every contiguous cut.

Covers: pipeswap/schedule/partition.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
from support import toy_layer, toy_profile_of

from pipeswap.errors import PipeswapError
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.partition import (
    Partition,
    describe,
    parse_balance,
    partition,
    stage_bounds,
    stage_memory_bytes,
)


def _profile(
    times: list[float], params: list[int] | None = None, saved: list[int] | None = None
) -> Profile:
    params = params or [1000] * len(times)
    saved = saved or [400] * len(times)
    layers = (
        toy_layer(f"l{i}", t / 3, 2 * t / 3, param_bytes=p, output_bytes=10, saved=[s])
        for i, (t, p, s) in enumerate(zip(times, params, saved))
    )
    return toy_profile_of(layers, batch=8, device="cpu", optimizer_state_bytes=sum(params))


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        out.append(tuple(b - a for a, b in zip(edges, edges[1:])))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers = rng.randint(2, 9)
    stages = rng.randint(1, layers)
    profile = _profile([rng.uniform(0.1, 5.0) for _ in range(layers)])
    best = min(max(describe(profile, bal).stage_seconds) for bal in _compositions(layers, stages))
    found = partition(profile, stages)
    assert sum(found.balance) == layers and len(found.balance) == stages
    assert found.bottleneck_s == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_memory_cap_matches_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    layers, stages = 7, 3
    profile = _profile(
        [rng.uniform(0.1, 5.0) for _ in range(layers)],
        params=[rng.randint(100, 5000) for _ in range(layers)],
        saved=[rng.randint(100, 5000) for _ in range(layers)],
    )
    kwargs = {"schedule": "async-1f1b", "weights": "stash"}
    all_cuts = [describe(profile, bal, **kwargs) for bal in _compositions(layers, stages)]
    cap = sorted(max(p.stage_memory_bytes) for p in all_cuts)[len(all_cuts) // 2]
    fitting = [p for p in all_cuts if max(p.stage_memory_bytes) <= cap]
    found = partition(profile, stages, memory_cap_bytes=cap, **kwargs)
    assert max(found.stage_memory_bytes) <= cap
    assert found.bottleneck_s == pytest.approx(min(p.bottleneck_s for p in fitting), rel=1e-12)


def test_uniform_layers_split_evenly() -> None:
    assert partition(_profile([1.0] * 8), 4).balance == (2, 2, 2, 2)
    assert partition(_profile([4.0, 1, 1, 1, 1]), 2).balance == (1, 4)


def test_stage_memory_closed_form() -> None:
    profile = _profile([1.0] * 4, params=[1000] * 4, saved=[400] * 4)
    # Stage 0 of 4 under async-1f1b keeps 4 mini-batches in flight; stash adds 4 weight
    # copies; optimizer state is shared by parameter bytes (2000 of 4000).
    got = stage_memory_bytes(profile, 0, 2, 0, 4, schedule="async-1f1b", weights="stash")
    assert got == (2 + 4) * 2000 + 2000 + 4 * 800
    got = stage_memory_bytes(profile, 0, 2, 3, 4, schedule="1f1b", micro_batches=4)
    assert got == 2 * 2000 + 2000 + 1 * 800 // 4


def test_infeasible_cap_names_the_smallest_possible() -> None:
    profile = _profile([1.0] * 4)
    with pytest.raises(PipeswapError, match=r"smallest possible is \d+ bytes \(balance"):
        partition(profile, 2, memory_cap_bytes=10)


def test_fewer_layers_than_stages() -> None:
    with pytest.raises(PipeswapError, match="stages 3 or fewer"):
        partition(_profile([1.0] * 3), 4)


def test_parse_balance() -> None:
    assert parse_balance("3,3,2,2", 10, 4) == (3, 3, 2, 2)
    for bad, message in (
        ("3,3,2", "has 3 stages"),
        ("3,3,2,1", "add"),
        ("a,b", "layer counts"),
        ("5,5,0,0", "at least one layer"),
    ):
        with pytest.raises(PipeswapError, match=message):
            parse_balance(bad, 10, 4)


def test_partition_json_round_trip() -> None:
    found = partition(_profile([1.0, 2.0, 3.0]), 2)
    assert Partition.from_json(found.to_json()) == found
    assert found.bounds == [(0, 2), (2, 3)]


def test_stage_bounds_cover_every_layer_once() -> None:
    assert stage_bounds((3, 1, 2)) == [(0, 3), (3, 4), (4, 6)]
    assert stage_bounds([5]) == [(0, 5)]
    assert stage_bounds(()) == []
