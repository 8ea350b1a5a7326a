"""benchmarks/family_bf16_swap.py --quick: Llama, GPT-2, BERT, ProphetNet and Funnel swap in
a bf16 loop (autocast's cache on) bit for bit, for every task they have."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import rows, run_quick


@pytest.mark.slow  # seconds of the fast suite's budget: it runs in `make test-slow`
def test_quick_bf16_swap(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    text = run_quick("family_bf16_swap.py", tmp_path / "bf16.md", timeout=180)
    families = {(r[0], r[1]): r[2:] for r in rows(text, "task | model type")}
    assert ("causal LM", "prophetnet") in families  # a weight its layers use twice
    for (task, model_type), (verdict, detail) in families.items():
        assert verdict.startswith("covered"), (task, model_type, detail)
        assert "0 tensors unmatched" in detail, (task, model_type, detail)
    # Llama's query, key and value projections read one normalised input: two of its three
    # bf16 casts are kept once.
    llama = families[("causal LM", "llama")][1]
    assert not llama.split(" KiB swapped, ")[1].startswith("0 KiB"), llama
    summary = rows(text, "task")
    assert all(row[-1] == "0" for row in summary), summary  # none differs
