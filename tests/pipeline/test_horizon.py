"""pipeswap.pipeline.horizon: a schedule built ahead of the calls and cut to the steps run."""

from __future__ import annotations

import itertools

import pytest

from pipeswap.pipeline.feed import step_ends
from pipeswap.schedule.kinds import SCHEDULE_NAMES
from pipeswap.schedule.timetable import build_schedule


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_begins_as_any_longer_one_up_to_its_last_call(name: str) -> None:
    """What the horizon rests on: the schedule of T steps and one of more run the same
    actions on every stage up to where the call of step T - 1 stops on the longer one,
    and stop the calls before it at the same places."""
    checked = 0
    for stages, micro, steps in itertools.product(range(1, 5), range(1, 5), range(1, 9)):
        try:
            short = build_schedule(name, stages, steps, micro)
        except Exception:  # a kind that refuses this many micro-batches
            continue
        for longer in (steps + 1, steps + 2 * stages + 3):
            long = build_schedule(name, stages, longer, micro)
            for rank in range(stages):
                long_ends = step_ends(long.actions[rank], micro, longer)
                short_ends = step_ends(short.actions[rank], micro, steps)
                ran = long_ends[steps - 1]
                assert short.actions[rank][:ran] == long.actions[rank][:ran]
                assert short_ends[: steps - 1] == long_ends[: steps - 1]
                checked += 1
    assert checked > 100
