"""A shape's plan in a user's loop, and the plan it replaced until the meter has read both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeswap.profiling.profile import Profile
from pipeswap.swap.plan.planner import PlanResult
from pipeswap.swap.runtime.executor import SwapExecutor

__all__ = ["REPLANS", "ShapePlan", "TriedPlan"]

REPLANS = 2  # a plan is made again (for less) at most this often when its step held more


@dataclass(frozen=True)
class TriedPlan:
    """A plan made before the current one, with the peak the meter read in its step: a plan
    made again for less can hold more where the memory model misjudged its new choices."""

    executor: SwapExecutor | None
    result: PlanResult
    peak_bytes: int


@dataclass
class ShapePlan:
    """A shape's plan, and its executor (one runs even where the plan moves nothing: it
    keeps a repeated cast once, pipeswap.profiling.cast_twins, as the plan's sizes assume).

    ``budget_bytes`` is the budget the user asked for, ``margin_bytes`` what the plans
    were made tighter by after measured steps held more; ``measured_peak_bytes`` the
    meter's reading of the first step that ran the current plan (None: not yet)."""

    executor: SwapExecutor | None
    result: PlanResult
    profile: Profile
    budget_bytes: int
    planning_s: float
    margin_bytes: int = 0
    replans: int = 0
    measured_peak_bytes: int | None = None
    replan_due: bool = False
    # The call it was made for, kept on the host: a plan made again must name the
    # tensors of that call, whichever smaller call it served when measured.
    call: tuple[Any, Any] | None = None
    recomputes_all: bool = False  # on_infeasible="recompute-all" made it, over the budget
    # The measured shapes its profile was derived from, before its first step (None: its
    # own step was measured), and the policy it is made again with (None: the run's).
    derived_from: str | None = None
    heuristic: str | None = None
    tried: TriedPlan | None = None  # the plan this one replaced, until this one is measured
    said_over: bool = False  # a read step of the user's held more than the budget: said once

    def keep_better(self) -> int | None:
        """Once the current plan's step is measured, the plan it replaced goes: closed where
        the current one held less, else back in its place for good (no more plans made
        again). Returns that plan's peak when it came back, else None."""
        tried, peak = self.tried, self.measured_peak_bytes
        if tried is None or peak is None:
            return None
        self.tried = None
        if peak < tried.peak_bytes:
            if tried.executor is not None:
                tried.executor.close()
            return None
        if self.executor is not None:
            self.executor.close()
        self.executor, self.result = tried.executor, tried.result
        self.measured_peak_bytes, self.replans = tried.peak_bytes, REPLANS
        return tried.peak_bytes
