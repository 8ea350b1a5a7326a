"""The auto policy: run every other policy and keep the plan that simulates fastest."""

from __future__ import annotations

from typing import Any

from pipeswap.swap.mip import plan_mip
from pipeswap.swap.policies import Case
from pipeswap.swap.scoring import Scored


def plan_auto(case: Case, *, time_limit_s: float = 60.0) -> tuple[Scored, dict[str, Any]]:
    """The MIP already scores oblivious, disjoint and bidirectional to pick its warm start,
    and keeps the warm start when its own plan simulates slower: its answer is the best."""
    outcome = plan_mip(case, time_limit_s=time_limit_s)
    notes = dict(outcome.notes)
    notes["mip_gap"] = outcome.mip_gap
    return outcome.scored, notes
