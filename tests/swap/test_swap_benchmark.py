"""The swap-policy benchmark's quick grid runs, and its report states the checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "swap_policies.py"


# Minutes of the fast suite's budget: it runs in `make test-slow`.
@pytest.mark.slow
def test_quick_grid_report(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("swap_policies_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "swap_policies.md"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "mip slower than some swap-only heuristic: 0 of 4 cases" in text
    assert (
        "hybrid slower than recompute, save-on-cpu (where they fit) or any swap-only "
        "policy: 0 of 4 cases; auto: 0 (target 0)." in text
    )
    assert "plans faster than a bound (would mean a bound is wrong): 0;" in text
    assert "GPUs over budget in simulation (plans that fit): 0." in text
    assert "0 of 32 give another iteration time, 0 put a GPU over its budget" in text
    for policy in ("save-on-cpu", "recompute", "hybrid"):
        assert f"| {policy} |" in text or f" {policy} |" in text
    assert "| 1.33 | 2 |" in text and "38.3%" in text
    assert "## One GPU: MIP vs the best heuristic" in text
