"""The per-stage compute orders of each schedule: warm-up, steady state, in-flight units.

Covers: pipeswap/schedule/orders.py (two_bw_orders: tests/pipeline/test_2bw.py).
"""

from __future__ import annotations

import pytest

from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.orders import (
    async_orders,
    gpipe_orders,
    one_f_one_b_orders,
    peak_in_flight,
    two_bw_orders,
)
from pipeswap.schedule.timetable import Schedule, build_schedule


def _max_in_flight(schedule: Schedule, stage: int) -> int:
    live, peak = 0, 0
    for action in schedule.compute_actions(stage):
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
        assert peak_in_flight(gpipe.compute_actions(k)) == micro


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


@pytest.mark.parametrize(
    "name,builder",
    [
        ("gpipe", gpipe_orders),
        ("1f1b", one_f_one_b_orders),
        ("async-1f1b", async_orders),
        ("2bw", two_bw_orders),
    ],
)
def test_a_schedule_is_its_builders_order_with_transfers(name: str, builder: object) -> None:
    micro = 1 if name == "async-1f1b" else 3
    schedule = build_schedule(name, 3, 4, micro)
    orders = builder(3, 4, micro, 1)  # type: ignore[operator]
    assert [schedule.compute_actions(k) for k in range(3)] == orders
    # Every stage runs each of its units' forward and backward once, and one UPDATE a step.
    for k, order in enumerate(orders):
        kinds = [a.kind for a in order]
        assert kinds.count(ActionKind.F) == kinds.count(ActionKind.B) == 4 * micro
        assert [a.unit for a in order if a.kind is ActionKind.UPDATE] == list(range(4))
        assert all(a.stage == k for a in order)


def test_peak_in_flight_counts_forwards_not_yet_backed() -> None:
    order = async_orders(3, 5)[0]
    assert peak_in_flight(order) == 3
    assert peak_in_flight([]) == 0
