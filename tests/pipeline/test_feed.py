"""A pipeline fed a step per call: each call's stop leaves no stage waiting forever, and
every stage that reads data reads a step's batch during the call that hands it over."""

from __future__ import annotations

import pytest
import torch

from pipeswap.pipeline.feed import FedBatches, step_ends, step_of
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import SCHEDULE_NAMES, Schedule, build_schedule


def _calls_finish(schedule: Schedule, steps: int) -> bool:
    """Run every rank as its own process would: a rank inside call t runs its actions up to
    ends[t] when their transfers have arrived, then enters call t + 1. True when all end."""
    micro = schedule.micro_batches
    ends = [step_ends(actions, micro, steps) for actions in schedule.actions]
    position = [0] * schedule.num_stages
    call = [0] * schedule.num_stages
    sent: set[tuple[ActionKind, int, int]] = set()  # (kind, destination, unit)
    moved = True
    while moved:
        moved = False
        for rank, actions in enumerate(schedule.actions):
            while position[rank] < len(actions):
                if position[rank] == ends[rank][call[rank]]:
                    call[rank] += 1  # the user's loop calls again
                    continue
                action = actions[position[rank]]
                if action.kind.is_pass and rank != (
                    0 if action.kind is ActionKind.F else schedule.num_stages - 1
                ):
                    if (action.kind, rank, action.unit) not in sent:
                        break  # blocked on its peer
                if action.kind.is_pass:
                    step = rank + (1 if action.kind is ActionKind.F else -1)
                    sent.add((action.kind, step, action.unit))
                position[rank] += 1
                moved = True
    return all(p == len(a) for p, a in zip(position, schedule.actions, strict=True))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stopping_after_each_step_never_deadlocks(name: str, stages: int) -> None:
    micro = 1 if name == "async-1f1b" else stages
    schedule = build_schedule(name, stages, 6, micro)
    assert _calls_finish(schedule, 6)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("stages", [2, 4])
def test_a_step_s_data_is_read_during_its_own_call(name: str, stages: int) -> None:
    micro = 1 if name == "async-1f1b" else stages
    schedule = build_schedule(name, stages, 5, micro)
    for rank in (0, stages - 1):
        actions = schedule.actions[rank]
        ends = step_ends(actions, micro, 5)
        for i, action in enumerate(actions):
            if action.kind is ActionKind.F:
                t = step_of(action, micro)
                assert (ends[t - 1] if t else 0) <= i < ends[t], (name, rank, str(action))


def test_fed_batches_hold_the_latest_step_in_micro_batches() -> None:
    fed = FedBatches(2)
    x, y = torch.arange(8).view(4, 2), torch.arange(4)
    fed.put(3, x, y)
    inputs, target = fed.micro(3, 1)
    assert inputs.tolist() == [[4, 5], [6, 7]] and target.tolist() == [2, 3]
    fed.put(4, x, y)
    assert list(fed.batches) == [4]
