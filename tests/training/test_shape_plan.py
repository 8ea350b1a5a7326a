"""pipeswap/training/shape_plan.py: of a plan and the one made again for less, the one that
held less on the meter is kept."""

from __future__ import annotations

from typing import Any

from pipeswap.training.shape_plan import REPLANS, ShapePlan, TriedPlan


class _Executor:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _replanned(before_peak: int, after_peak: int) -> tuple[ShapePlan, Any, Any]:
    before, after = _Executor(), _Executor()
    placeholder: Any = None
    planned = ShapePlan(after, "after", placeholder, 1000, 0.0, replans=1)  # type: ignore[arg-type]
    planned.tried = TriedPlan(before, "before", before_peak)  # type: ignore[arg-type]
    planned.measured_peak_bytes = after_peak
    return planned, before, after


def test_a_plan_made_again_that_holds_less_stays_and_the_one_before_is_closed() -> None:
    planned, before, after = _replanned(1100, 950)
    assert planned.keep_better() is None
    assert before.closed and not after.closed
    assert (planned.executor, planned.result, planned.tried) == (after, "after", None)
    assert (planned.measured_peak_bytes, planned.replans) == (950, 1)


def test_a_plan_made_again_that_holds_more_gives_way_to_the_one_before_for_good() -> None:
    planned, before, after = _replanned(1100, 1300)
    assert planned.keep_better() == 1100
    assert after.closed and not before.closed
    assert (planned.executor, planned.result, planned.tried) == (before, "before", None)
    assert (planned.measured_peak_bytes, planned.replans) == (1100, REPLANS)


def test_nothing_is_kept_or_closed_before_the_plan_is_measured() -> None:
    planned, before, after = _replanned(1100, 1300)
    planned.measured_peak_bytes = None
    assert planned.keep_better() is None
    assert not before.closed and not after.closed and planned.tried is not None
