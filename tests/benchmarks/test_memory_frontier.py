"""benchmarks/memory_frontier.py --quick: every pipeswap row within its budget, same losses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bench_support import ROOT, rows, run_quick

sys.path.insert(0, str(ROOT / "benchmarks"))
from memory_frontier import FINER, MiB, per_mib_freed  # noqa: E402


@pytest.mark.slow  # 11 s: make test-slow (make test's time)
def test_quick_memory_frontier(tmp_path: Path) -> None:
    out = tmp_path / "memory_frontier.md"
    text = run_quick("memory_frontier.py", out)
    table = {row[0]: row for row in rows(text, "way")}
    plain, full = table["plain"], table["full AC (HF, per layer)"]
    assert plain[6] == "bit-identical" and float(plain[5]) == 1.0
    assert float(full[2]) < float(plain[2])  # checkpointing every layer held less
    assert full[6] == "bit-identical" and table["selective AC (op SAC)"][6] == "bit-identical"
    ours = [row for name, row in table.items() if name.startswith("pipeswap")]
    ran = [row for row in ours if row[2] != "-"]
    assert ran, "pipeswap ran at no budget"
    for name, budget, peak, over, _ms, _x, losses, _notes in ran:
        assert float(peak) <= float(budget) * 1.02, name
        assert float(over) <= 1.02 and losses == "bit-identical", name
    for row in ours:
        if row[2] == "-":  # refused: the row says so (naming the smallest budget, if known)
            assert row[-1].startswith("refused"), row
    for name in ("TRL activation offloading", "Transformer Engine offload"):
        assert table[name][-1] in ("not installed here", "installed, but not run by this benchmark")
    assert (tmp_path / "memory_frontier.png").stat().st_size > 0
    assert "](memory_frontier.png)" in text
    # Finer than a block: both recompute-only rows of each budget ran or were both refused,
    # and where they ran, the finer row's time added to plain is stated as a ratio.
    finer = rows(text, "budget")
    assert finer, "no finer-than-a-block table"
    for budget, whole, chosen, added, step in finer:
        assert (whole == "-") == (chosen == "-"), budget
        if whole != "-":  # a ratio, or a dash where noise put plain's median above
            assert added.startswith("-") or float(added) >= 0, budget
            assert float(step) > 0, budget


def _ran(name: str, kind: str, peak_mib: float, step_ms: float) -> dict[str, object]:
    return {
        "spec": {"name": name, "kind": kind},
        "status": "ran",
        "peaks": [int(peak_mib * MiB)],
        "times": [step_ms / 1e3],
    }


def test_time_per_mib_freed_is_a_ratio_of_costs_per_byte() -> None:
    # plain 200 MiB at 100 ms; whole blocks free 100 MiB for 50 ms (0.5 ms/MiB), finer 60 MiB
    # for 24 ms (0.4); full AC 120 MiB for 60 ms (0.5), op SAC 50 MiB for 40 ms (0.8).
    records = [
        _ran("plain", "plain", 200, 100),
        _ran(f"{FINER} whole blocks, no-swap/2", "pipeswap", 100, 150),
        _ran(f"{FINER} finer, no-swap/2", "pipeswap", 140, 124),
        _ran("full AC (HF, per layer)", "peer", 80, 160),
        _ran("selective AC (op SAC)", "peer", 150, 140),
    ]
    line = per_mib_freed(records)
    assert "pipeswap finer / whole blocks at no-swap/2: 0.40 / 0.50 ms per MiB = 0.80" in line
    assert "op SAC / full AC: 0.80 / 0.50 ms per MiB = 1.60" in line
    # A way that frees nothing, or adds no time, has no cost per byte: no ratio for it.
    frees_nothing = _ran("selective AC (op SAC)", "peer", 200, 140)
    assert "op SAC" not in per_mib_freed([*records[:4], frees_nothing])
