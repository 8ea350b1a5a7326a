"""Version distances walked from the schedule, against the official SpecTrain table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.pipeline.predict import (
    DISTANCE_RULES,
    official_distances,
    steady_distances,
    step_direction,
    version_distances,
)
from pipeswap.schedule.timetable import build_schedule


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 6, 8])
def test_walked_distances_are_the_table_minus_floor_half_k(stages: int) -> None:
    """Documented difference (see pipeswap.pipeline.predict): the official table targets the
    version after every stage applied the mini-batch's update; that is floor(k/2) more
    updates of stage k than the version its own update is applied to, which the walk counts.
    """
    schedule = build_schedule("async-1f1b", stages, 4 * stages)
    for k in range(stages):
        forward, backward = steady_distances(schedule, k)
        table_forward, table_backward = official_distances(stages, k)
        assert (forward, backward) == (stages - k - 1, 0)
        assert table_forward - forward == k // 2
        assert table_backward - backward == k // 2


def test_warm_up_distances_count_only_updates_that_happen() -> None:
    stages = 4
    schedule = build_schedule("async-1f1b", stages, 10)
    for k in range(stages):
        distances = version_distances(schedule, k)
        for unit in range(10):
            # Mini-batch u's forward sees the updates of u-(N-k-1) .. u-1 that exist.
            assert distances[("F", unit)] == min(unit, stages - k - 1)
            assert distances[("B", unit)] == 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("rule", DISTANCE_RULES)
def test_synchronous_schedules_have_no_staleness(name: str, rule: str) -> None:
    schedule = build_schedule(name, 4, 3, 4)
    for k in range(4):
        assert set(version_distances(schedule, k, rule).values()) == {0}


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 6, 8])
def test_official_rule_gives_exactly_the_table_in_steady_state(stages: int) -> None:
    schedule = build_schedule("async-1f1b", stages, 4 * stages)
    for k in range(stages):
        assert steady_distances(schedule, k, "official") == official_distances(stages, k)
        walked = version_distances(schedule, k)
        official = version_distances(schedule, k, "official")
        # Every pass, warm-up included, gets floor(k/2) more than the walk.
        assert official.keys() == walked.keys()
        assert all(official[key] == s + k // 2 for key, s in walked.items())


def test_schedule_rule_is_the_default_walk() -> None:
    schedule = build_schedule("async-1f1b", 4, 10)
    for k in range(4):
        assert version_distances(schedule, k, "schedule") == version_distances(schedule, k)
    with pytest.raises(ValueError, match="schedule, official"):
        version_distances(schedule, 0, "table")


def test_step_direction_matches_the_optimizer_step() -> None:
    torch.manual_seed(0)
    for make in (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
        lambda p: torch.optim.Adam(p, lr=0.1, foreach=False),
        lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=False),
    ):
        param = nn.Parameter(torch.randn(5))
        optimizer = make([param])
        assert step_direction(optimizer, param) is None
        for _ in range(3):
            param.grad = torch.randn(5)
            optimizer.step()
        # With the same gradient again, the next step moves by about -lr * d.
        before = param.detach().clone()
        direction = step_direction(optimizer, param).clone()
        param.grad = torch.zeros(5)
        if isinstance(optimizer, torch.optim.SGD):
            optimizer.step()
            # SGD with zero gradient: buf <- 0.9 buf, step -0.1 * 0.9 buf.
            torch.testing.assert_close(param.detach(), before - 0.1 * 0.9 * direction)
        else:
            assert direction.shape == before.shape and torch.isfinite(direction).all()
