"""The demo's own Hugging Face model, tokenizer and corpus, made offline.

Covers: pipeswap/commands/demo_model.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeswap.commands.demo_model import VOCAB, make_demo_model, sample, stdlib_docstrings
from pipeswap.user_data import load_tokenizer


def test_the_demo_model_has_its_own_tokenizer_and_a_corpus_that_ships_with_python(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    corpus, model = make_demo_model(tmp_path)
    documents = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert documents == stdlib_docstrings() and len(documents) > 100
    loaded = load_tokenizer(str(model))  # what --data tokenizes the corpus with
    assert loaded is not None
    encode, eos = loaded
    ids = encode(documents[0])
    assert 0 <= min(ids) and max(ids) < VOCAB and eos < VOCAB
    assert len(ids) < len(documents[0].encode()) / 1.5  # BPE merges, not bytes
    text = sample(model, "Return the", tokens=4)
    assert text.startswith("Return the") and len(text) > len("Return the")
