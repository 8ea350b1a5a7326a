"""Placements: in order, by stage, Mobius's rule, and the search over switch groups."""

from __future__ import annotations

import random

import pytest
from layout_toys import toy

from pipeswap.hardware.presets import preset
from pipeswap.schedule.timetable import build_schedule
from pipeswap.swap.plan.channels import channel_groups
from pipeswap.swap.plan.stage_costs import stage_costs
from pipeswap.swap.plan.stage_mapping import (
    cross_mapping,
    mobius_mapping,
    overlap_s,
    replica_major,
    stage_major,
    transfer_windows,
)
from pipeswap.swap.plan.stage_swap import NO_PLAN, StagePlan

GPUS = [f"gpu{i}" for i in range(8)]


def _switch_of(topology, gpu: str) -> int:
    return next(i for i, g in enumerate(channel_groups(topology, topology.gpus)) if gpu in g)


def test_replica_major_and_stage_major_rows() -> None:
    assert replica_major(GPUS, 4, 2) == (tuple(GPUS[:4]), tuple(GPUS[4:]))
    assert stage_major(GPUS, 4, 2) == (
        ("gpu0", "gpu2", "gpu4", "gpu6"),
        ("gpu1", "gpu3", "gpu5", "gpu7"),
    )


def test_mobius_puts_consecutive_stages_under_different_switches() -> None:
    topology = preset("single-root-8")
    (row,) = mobius_mapping(topology, topology.gpus, 8, 1)
    switches = [_switch_of(topology, g) for g in row]
    assert switches == [0, 1, 2, 3, 0, 1, 2, 3]


def test_overlap_of_intervals() -> None:
    assert overlap_s([(0, 2), (5, 6)], [(1, 5.5)]) == 1.5
    rng = random.Random(0)
    for _ in range(50):
        a = [(t, t + 0.7) for t in sorted(rng.uniform(0, 10) for _ in range(8))]
        b = [(t, t + 0.3) for t in sorted(rng.uniform(0, 10) for _ in range(8))]
        brute = sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)
        assert overlap_s(a, b) == pytest.approx(brute)


def _case(plans):
    profile = toy(8)
    schedule = build_schedule("1f1b", 4, 2, 4)
    costs = stage_costs(profile, (2, 2, 2, 2), schedule="1f1b", micro_batches=4, weights="stale")
    return schedule, costs, transfer_windows(schedule, costs, plans, 12e9)


def test_without_copies_neighbours_share_a_switch() -> None:
    topology = preset("switch-4")
    schedule, costs, windows = _case([NO_PLAN] * 4)
    assert all(not w["d2h"] and not w["h2d"] for w in windows)
    (row,) = cross_mapping(topology, topology.gpus, costs, windows, replicas=1, units=8, steps=2)
    assert _switch_of(topology, row[0]) == _switch_of(topology, row[1])
    assert _switch_of(topology, row[2]) == _switch_of(topology, row[3])


def test_stages_copying_at_once_go_under_different_switches() -> None:
    topology = preset("switch-4")
    swap_all = StagePlan(swapped=frozenset(range(8)))
    schedule, costs, windows = _case([swap_all] * 4)
    pairs = {
        (i, j): sum(overlap_s(windows[i][d], windows[j][d]) for d in ("d2h", "h2d"))
        for i in range(4)
        for j in range(i + 1, 4)
    }
    (row,) = cross_mapping(topology, topology.gpus, costs, windows, replicas=1, units=8, steps=2)
    together = [
        (i, j) for (i, j) in pairs if _switch_of(topology, row[i]) == _switch_of(topology, row[j])
    ]
    chosen = sum(pairs[p] for p in together)
    # No pairing of the four stages has less same-direction overlap (p2p is free here:
    # the toy's outputs are empty).
    pairings = [[(0, 1), (2, 3)], [(0, 2), (1, 3)], [(0, 3), (1, 2)]]
    assert chosen == min(sum(pairs[p] for p in pairing) for pairing in pairings)
