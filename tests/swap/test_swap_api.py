"""pipeswap.swap's public names: each loads on first use, and reading the config loads nothing.

Covers: pipeswap/swap/__init__.py.
"""

from __future__ import annotations

import subprocess
import sys

import pipeswap.swap as swap
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.planner import PlanResult, make_plan
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.swap_config import SwapConfig


def test_public_names_are_the_modules_own() -> None:
    assert sorted(swap.__all__) == sorted(dir(swap))
    assert swap.SwapPlan is SwapPlan
    assert swap.make_plan is make_plan
    assert swap.PlanResult is PlanResult
    assert swap.SwapExecutor is SwapExecutor
    assert swap.SwapConfig is SwapConfig
    for name in swap.__all__:
        assert getattr(swap, name) is not None


def test_reading_the_config_loads_neither_the_planner_nor_torch() -> None:
    code = (
        "import sys, pipeswap.swap.swap_config; "
        "print(sorted(m for m in ('torch', 'pipeswap.swap.plan.planner') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
