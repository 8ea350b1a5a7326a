"""Tiny encoder-decoders (T5, BART) saved as model directories with a tokenizer, and pairs to train on.

Made offline from configs: a word-level tokenizer over a few made-up words (its special
tokens where each family keeps them, a template that ends each text as the family's
tokenizer does) and a 2+2-block model initialised from a seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

WORDS = [f"w{i}" for i in range(24)]
# Special tokens by family, in id order: T5 pads with 0 and ends with </s>; BART starts
# with <s> and pads with 1.
_SPECIALS = {
    "t5": ["<pad>", "</s>", "<unk>"],
    "bart": ["<s>", "<pad>", "</s>", "<unk>"],
}


def _tokenizer(family: str) -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    specials = _SPECIALS[family]
    vocab = {token: i for i, token in enumerate([*specials, *WORDS])}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    ids = {s: vocab[s] for s in specials}
    if family == "t5":
        template = tokenizers.processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", ids["</s>"])]
        )
        named = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    else:
        template = tokenizers.processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])]
        )
        named = {
            "bos_token": "<s>",
            "pad_token": "<pad>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        }
    tok.post_processor = template
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **named)


def save_seq2seq(directory: Path, family: str, *, dropout: float = 0.1) -> str:
    """A tiny ``family`` (t5 or bart) encoder-decoder and its tokenizer saved in ``directory``."""
    transformers = pytest.importorskip("transformers")
    vocab = len(_SPECIALS[family]) + len(WORDS)
    if family == "t5":
        config = transformers.T5Config(
            vocab_size=vocab,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            dropout_rate=dropout,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
        cls = transformers.T5ForConditionalGeneration
    else:
        config = transformers.BartConfig(
            vocab_size=vocab,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=dropout,
            bos_token_id=0,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
        )
        cls = transformers.BartForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(directory)
    _tokenizer(family).save_pretrained(directory)
    return str(directory)


def pair_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """``count`` examples of a task a tiny model learns quickly: write the words reversed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = rng.choices(WORDS, k=rng.randint(2, 6))
        rows.append({"question": " ".join(words), "answer": " ".join(reversed(words))})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)
