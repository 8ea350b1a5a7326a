"""benchmarks/memory_frontier.py --quick: every pipeswap row within its budget, same losses."""

from __future__ import annotations

from pathlib import Path

from bench_support import rows, run_quick


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
