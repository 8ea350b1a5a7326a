"""benchmarks/family_padded_recompute.py --quick: Llama, GPT-2, BERT, GraniteMoE, Funnel and
CTRL recompute padded batches bit for bit, for every task they have, and refuse a call that
asks for the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import rows, run_quick


@pytest.mark.slow  # 12 s: make test-slow (make test's time)
def test_quick_padded_recompute(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    text = run_quick("family_padded_recompute.py", tmp_path / "padded.md", timeout=120)
    summary = rows(text, "task")
    # task, model types, ran plainly, covered at 1.2, at its smallest budget, covered, of
    # those that ran, cache calls refused
    assert summary == [
        ["causal LM", "5", "5", "4", "1", "5 (100%)", "5/5", "5/5"],
        ["masked LM", "2", "2", "2", "0", "2 (100%)", "2/2", "1/1"],
        ["sequence classification", "5", "5", "4", "1", "5 (100%)", "5/5", "4/4"],
    ]
    families = {(r[0], r[1]): r[2:] for r in rows(text, "task | model type")}
    assert set(families) == {
        *(("causal LM", n) for n in ("bert", "ctrl", "gpt2", "granitemoe", "llama")),
        ("masked LM", "bert"),
        ("masked LM", "funnel"),
        *(("sequence classification", n) for n in ("bert", "ctrl", "funnel", "gpt2", "llama")),
    }
    for (task, model_type), (cache, verdict, detail, refusal) in families.items():
        if model_type == "ctrl":  # 2 layers free less than 1.2 asks: at the plan's budget
            assert verdict == "covered at its smallest budget (1.2 refused)", detail
            assert "at 1.2 refused: the smallest budget is" in detail
        else:
            assert verdict == "covered", (task, model_type, detail)
        layers = 4 if model_type == "funnel" else 2  # Funnel: the first block's 4 layers
        assert detail.startswith(f"{layers} of {layers} layers re-run"), detail
        if model_type == "funnel":  # no use_cache anywhere
            assert (cache, refusal) == ("-", "-")
            continue
        assert cache == "on"  # the family's default: offload, not the config, turns it off
        # transformers 5 names the key-value cache `cache`; BERT's masked LM and classifier
        # take use_cache through **kwargs only (GraniteMoE's causal LM names `cache`).
        bert_encoder = model_type == "bert" and task != "causal LM"
        assert refusal == (
            "refused: use_cache=True" if bert_encoder else "refused: use_cache=True, cache"
        ), (task, model_type)
    assert "image classification" not in [r[0] for r in summary]
    assert "no attention mask" in text and "`use_cache=False`" in text
