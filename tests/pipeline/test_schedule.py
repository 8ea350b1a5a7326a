"""Schedules as data: string form, builders' structure, closed-form makespans."""

from __future__ import annotations

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.pipeline.schedule import ACTION_KINDS, Action, Schedule, build_schedule
from pipeswap.pipeline.validate import simulate


def test_action_string_round_trip() -> None:
    for kind in ACTION_KINDS:
        action = Action(3, kind, 12)
        assert Action.parse(str(action)) == action
    assert str(Action(2, "F", 5)) == "2F5"
    assert str(Action(1, "B", 3)) == "1B3"
    with pytest.raises(PipeswapError, match="2F5"):
        Action.parse("F2")


@pytest.mark.parametrize("name,micro", [("gpipe", 3), ("1f1b", 3), ("async-1f1b", 1), ("2bw", 3)])
def test_schedule_round_trips_through_string_and_json(name: str, micro: int) -> None:
    schedule = build_schedule(name, 3, 2, micro)
    again = Schedule.from_string(schedule.to_string(), name=name, num_steps=2, micro_batches=micro)
    assert again == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule


def _max_in_flight(schedule: Schedule, rank: int) -> int:
    live, peak = 0, 0
    for action in schedule.compute_actions(rank):
        live += {"F": 1, "B": -1}.get(action.kind, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages,micro", [(2, 2), (4, 4), (4, 8), (3, 2)])
def test_in_flight_units_per_stage(stages: int, micro: int) -> None:
    gpipe = build_schedule("gpipe", stages, 2, micro)
    one_f_one_b = build_schedule("1f1b", stages, 2, micro)
    async_ = build_schedule("async-1f1b", stages, 3 * stages, 1)
    for k in range(stages):
        assert _max_in_flight(gpipe, k) == micro
        assert _max_in_flight(one_f_one_b, k) == min(stages - k, micro)
        assert _max_in_flight(async_, k) == stages - k


def test_async_alternates_forward_of_newer_with_backward_of_older() -> None:
    n, steps = 4, 10
    schedule = build_schedule("async-1f1b", n, steps)
    for k in range(n):
        order = [str(a) for a in schedule.compute_actions(k)]
        expected = [f"{k}F{u}" for u in range(n - k)]
        for u in range(steps):
            expected += [f"{k}B{u}", f"{k}UPDATE{u}"]
            if u + n - k < steps:
                expected.append(f"{k}F{u + n - k}")
        assert order == expected


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8)])
def test_sync_makespan_is_two_times_micro_plus_stages_minus_one(
    name: str, stages: int, micro: int
) -> None:
    steps = 2
    timeline = simulate(build_schedule(name, stages, steps, micro))
    # Each step fills and drains the pipe: (M + N - 1) forward and backward slots, flush.
    assert max(t.end for t in timeline) == steps * 2 * (micro + stages - 1)


def test_async_makespan_has_one_fill_and_one_drain() -> None:
    stages, steps = 4, 8
    timeline = simulate(build_schedule("async-1f1b", stages, steps))
    assert max(t.end for t in timeline) == 2 * steps + 2 * (stages - 1)


def test_builder_errors_name_the_fix() -> None:
    with pytest.raises(PipeswapError, match="gpipe, 1f1b, async-1f1b"):
        build_schedule("zb-v", 2, 1)
    with pytest.raises(PipeswapError, match="--schedule 1f1b"):
        build_schedule("async-1f1b", 2, 4, micro_batches=2)
    with pytest.raises(PipeswapError, match="at least 1"):
        build_schedule("gpipe", 0, 1)


def test_action_kinds_are_an_enum_that_keeps_the_compact_form() -> None:
    from pipeswap.pipeline.schedule import ActionKind

    action = Action(2, "SEND_F", 5)
    assert action.kind is ActionKind.SEND_F and action == Action(2, ActionKind.SEND_F, 5)
    assert str(action) == "2SEND_F5" and Action.parse("2SEND_F5") == action
    assert [k.value for k in ActionKind] == [
        "F",
        "B",
        "SEND_F",
        "RECV_F",
        "SEND_B",
        "RECV_B",
        "UPDATE",
    ]
