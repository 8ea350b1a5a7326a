"""benchmarks/layouts.py --quick: one well-formed row whose best layout is the fastest that fits."""

from __future__ import annotations

from pathlib import Path

from bench_support import number, rows, run_quick

from pipeswap.profiling.estimate import estimate


def test_quick_layouts_table(tmp_path: Path) -> None:
    text = run_quick("layouts.py", tmp_path / "layouts.md")
    (row,) = rows(text, "model")
    assert row[:3] == ["resnet50", "switch-4", "2.50 GiB"]
    best = number(row[4])
    families = [number(c) for c in row[5:10] if c != "no fit"]
    assert families and max(families) == best
    assert number(row[10]) >= 1.0 and number(row[11]) >= 1.0  # best / DP, best / pipeline
    # Four GPUs never beat four times one GPU's compute of its 32 samples.
    assert best <= 4 * 32 / estimate("resnet50", 32, gpu="v100-32gb").compute_s
    assert "Best family, by count of cases" in text
