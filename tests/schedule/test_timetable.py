"""Schedules as data: string and JSON forms, the builder's checks, unit-time makespans.

Covers: pipeswap/schedule/timetable.py (the compute orders: tests/schedule/test_orders.py).
"""

from __future__ import annotations

import time

import pytest

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.schedule import timetable as schedule_module
from pipeswap.schedule.timetable import (
    Schedule,
    ScheduleError,
    build_schedule,
    listing,
    unit_time_order,
)


@pytest.mark.parametrize("name,micro", [("gpipe", 3), ("1f1b", 3), ("async-1f1b", 1), ("2bw", 3)])
def test_schedule_round_trips_through_string_and_json(name: str, micro: int) -> None:
    schedule = build_schedule(name, 3, 2, micro)
    again = Schedule.from_string(schedule.to_string(), name=name, num_steps=2, micro_batches=micro)
    assert again == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8)])
def test_sync_makespan_is_two_times_micro_plus_stages_minus_one(
    name: str, stages: int, micro: int
) -> None:
    steps = 2
    timeline = unit_time_order(build_schedule(name, stages, steps, micro))
    # Each step fills and drains the pipe: (M + N - 1) forward and backward ticks, flush.
    assert max(t.end for t in timeline) == steps * 2 * (micro + stages - 1)


def test_async_makespan_has_one_fill_and_one_drain() -> None:
    stages, steps = 4, 8
    timeline = unit_time_order(build_schedule("async-1f1b", stages, steps))
    assert max(t.end for t in timeline) == 2 * steps + 2 * (stages - 1)


def test_builder_errors_name_the_fix() -> None:
    with pytest.raises(PipeswapError, match="gpipe, 1f1b, async-1f1b"):
        build_schedule("zb-v", 2, 1)
    with pytest.raises(PipeswapError, match="schedule 1f1b"):
        build_schedule("async-1f1b", 2, 4, micro_batches=2)
    with pytest.raises(PipeswapError, match="at least 1"):
        build_schedule("gpipe", 0, 1)


def test_unit_time_order_waits_for_sends_and_names_a_deadlock() -> None:
    schedule = build_schedule("1f1b", 2, 1, 1)
    timeline = unit_time_order(schedule, forward_cost=2, backward_cost=3)
    at = {str(t.action): t for t in timeline}
    # Stage 1 receives unit 0 when stage 0's forward has sent it, then computes.
    assert (at["1RECV_F0"].start, at["1F0"].start, at["1F0"].end) == (2, 2, 4)
    assert at["0B0"].start == at["1SEND_B0"].end == 7 and at["0B0"].end == 10
    assert [t.index for t in timeline if t.stage == 0] == list(range(len(schedule.actions[0])))
    stuck = Schedule.from_string(
        "0: 0F0 0RECV_B0 0SEND_F0 0B0 0UPDATE0\n1: 1RECV_F0 1F0 1B0 1SEND_B0 1UPDATE0",
        name="1f1b",
        num_steps=1,
        micro_batches=1,
    )
    with pytest.raises(ScheduleError, match="deadlock") as info:
        unit_time_order(stuck)
    assert (info.value.stage, info.value.index) == (0, 1)
    assert listing(stuck, {0: 1}).splitlines()[0] == "stage 0: 0F0 [0RECV_B0] 0SEND_F0 0B0 0UPDATE0"


def test_a_schedule_knows_its_table_entry() -> None:
    assert build_schedule("2bw", 2, 2, 2).kind.forward_lag == 1
    assert build_schedule("gpipe", 2, 2, 2).synchronous
    assert not build_schedule("async-1f1b", 2, 2).synchronous
    odd = Schedule.from_string("0: 0F0 0B0 0UPDATE0", name="zb", num_steps=1, micro_batches=1)
    with pytest.raises(PipeswapError, match="unknown schedule 'zb'"):
        odd.kind  # noqa: B018


def test_a_schedule_too_large_to_hold_is_refused_before_it_is_built() -> None:
    # Before: 10^12 steps built actions until memory ran out (MemoryError after 76 s).
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"more than the 5,000,000 a run may build up front"):
        build_schedule("async-1f1b", 4, 10**12, 1)
    assert time.perf_counter() - started < 1
    per_step = 4 * 1 * schedule_module.ACTIONS_PER_PASS_PAIR + 4
    most = schedule_module.MAX_ACTIONS // per_step
    schedule_module._check_size("async-1f1b", 4, most, 1)  # the largest allowed passes
    with pytest.raises(ConfigError, match=f"use at most {most:,} steps per run"):
        schedule_module._check_size("async-1f1b", 4, most + 1, 1)
    built = build_schedule("async-1f1b", 4, 50, 1)
    assert sum(len(row) for row in built.actions) <= 50 * per_step  # the count is an upper bound
