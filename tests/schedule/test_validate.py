"""The validator accepts every built schedule and pinpoints broken ones.

Covers: pipeswap/schedule/validate.py.
"""

from __future__ import annotations

import pytest

from pipeswap.schedule.timetable import Schedule, build_schedule, unit_time_order
from pipeswap.schedule.validate import ScheduleError, validate


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "async-1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_every_built_schedule_is_valid(name: str, stages: int, micro: int) -> None:
    micro = 1 if name == "async-1f1b" else micro
    schedule = build_schedule(name, stages, 3, micro)
    validate(schedule)
    order = unit_time_order(schedule)
    assert len(order) == sum(len(acts) for acts in schedule.actions)


def _two_stage(stage0: str, stage1: str, name: str = "1f1b") -> Schedule:
    return Schedule.from_string(
        f"0: {stage0}\n1: {stage1}", name=name, num_steps=1, micro_batches=1
    )


def test_deadlock_is_reported_with_the_stuck_actions_marked() -> None:
    # Stage 0 waits for the gradient before it has sent the activation that produces it.
    schedule = _two_stage(
        "0F0 0RECV_B0 0SEND_F0 0B0 0UPDATE0", "1RECV_F0 1F0 1B0 1SEND_B0 1UPDATE0"
    )
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(schedule)
    assert "[0RECV_B0]" in str(info.value) and "[1RECV_F0]" in str(info.value)
    assert info.value.stage == 0 and info.value.index == 1


def test_backward_before_forward_is_refused() -> None:
    schedule = _two_stage(
        "0F0 0SEND_F0 0RECV_B0 0B0 0UPDATE0", "1RECV_F0 1B0 1F0 1SEND_B0 1UPDATE0"
    )
    with pytest.raises(ScheduleError, match="backward of unit 0 before its forward"):
        validate(schedule)


def test_unmatched_send_is_refused() -> None:
    schedule = _two_stage("0F0 0SEND_F0 0RECV_B0 0B0 0UPDATE0", "1RECV_F0 1F0 1B0 1UPDATE0")
    with pytest.raises(ScheduleError, match="missing SEND_B"):
        validate(schedule)


def test_transfers_out_of_order_are_refused() -> None:
    # Stage 1 receives unit 1 first although stage 0 sends unit 0 first.
    rows = build_schedule("gpipe", 2, 1, 2).to_string().splitlines()
    rows[1] = "1: 1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1 1UPDATE0"
    schedule = Schedule.from_string("\n".join(rows), name="gpipe", num_steps=1, micro_batches=2)
    with pytest.raises(ScheduleError, match="must match in order"):
        validate(schedule)


def test_synchronous_schedule_must_flush_before_the_next_step() -> None:
    schedule = build_schedule("gpipe", 1, 2, 1)
    broken = Schedule.from_string(
        "0: 0F0 0F1 0B0 0UPDATE0 0B1 0UPDATE1", name="gpipe", num_steps=2, micro_batches=1
    )
    validate(schedule)
    with pytest.raises(ScheduleError, match="0F1 comes before 0UPDATE0"):
        validate(broken)
    # The same order is fine without a flush.
    validate(
        Schedule.from_string(
            "0: 0F0 0F1 0B0 0UPDATE0 0B1 0UPDATE1", name="async-1f1b", num_steps=2, micro_batches=1
        )
    )


def test_action_on_the_wrong_rank_is_refused() -> None:
    schedule = _two_stage("0F0 1F0", "1RECV_F0 1F0 1B0 1SEND_B0 1UPDATE0")
    with pytest.raises(ScheduleError, match="belongs to stage 1"):
        validate(schedule)
