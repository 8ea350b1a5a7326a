"""What one executor step reports.

Covers: pipeswap/swap/runtime/stats.py.
"""

from __future__ import annotations

import dataclasses

from pipeswap.swap.runtime.stats import StepStats


def test_step_stats_report_every_field() -> None:
    stats = StepStats(100, 40, 40, 1, 0.5, recomputed_layers=2, recomputed_bytes=64)
    assert stats.to_json() == dataclasses.asdict(stats)
    assert StepStats(0, 0, 0, 0, 0.0).to_json()["recomputed_layers"] == 0
