"""benchmarks/stage_swap.py --quick: the swapping run holds less, within its budget, same bits."""

from __future__ import annotations

from pathlib import Path

from bench_support import rows, run_quick


def test_quick_stage_swap_table(tmp_path: Path) -> None:
    text = run_quick("stage_swap.py", tmp_path / "stage_swap.md")
    keep, disjoint = rows(text, "policy")
    assert keep[0] == "keep" and disjoint[0] == "disjoint"
    assert float(disjoint[2].rstrip("x")) < 1.0  # it held less than keeping everything
    assert disjoint[4] == "yes" and disjoint[-1] == "yes"  # within budget, the same bits
    assert disjoint[5] != "0 B"
    assert "every stage of every planned run within its budget: yes" in text
    assert "Budget " in text and "what it leaves for saved tensors" in text
