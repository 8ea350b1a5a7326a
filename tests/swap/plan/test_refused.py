"""pipeswap/swap/plan/refused.py: a budget refusal, as it crosses processes."""

from __future__ import annotations

import pickle

from pipeswap.swap.plan.refused import BudgetRefused


def test_a_refusal_crosses_processes_as_it_was_made() -> None:
    refused = BudgetRefused("too small: {gpu_memory_bytes}", floor=7, peak=100, smallest=50)
    again = pickle.loads(pickle.dumps(refused))
    assert type(again) is BudgetRefused
    assert (again.message, again.reason, again.floor, again.peak) == (
        refused.message,
        refused.reason,
        7,
        100,
    )
    assert str(again) == str(refused) and "pass gpu_memory_bytes 50 or more" in str(again)
