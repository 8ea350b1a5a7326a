"""The demo's own small Hugging Face model, tokenizer and corpus, made offline; and its sample.

The corpus is the docstrings of the Python standard library's modules (they ship with
every Python), one JSON line per module. The tokenizer is a byte-level BPE of 512
tokens trained on that corpus with Hugging Face ``tokenizers``; the model a 4-block
Llama (grouped-query attention) initialised from a seed. Nothing is downloaded.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import torch

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import write_atomic
from pipeswap.models.load import library_bars

__all__ = ["EOS", "VOCAB", "make_demo_model", "sample", "stdlib_docstrings"]

EOS = "<|endoftext|>"
VOCAB = 512


def stdlib_docstrings(limit: int = 200) -> list[str]:
    """The module docstrings of the first ``limit`` standard-library modules, by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for file in sorted(root.glob("*.py"))[:limit]:
        try:
            text = ast.get_docstring(ast.parse(file.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if text:
            found.append(text)
    return found


def make_demo_model(out: Path) -> tuple[Path, Path]:
    """Write the corpus (JSON lines) and the model directory (config, seeded weights,
    tokenizer) under ``out``; returns (corpus, model directory)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError:
        raise PipeswapError(
            "the Hugging Face steps of the demo need transformers: pip install 'pipeswap[hf]'"
        ) from None
    documents = stdlib_docstrings()
    corpus = out / "corpus.jsonl"
    write_atomic(corpus, "".join(json.dumps({"text": d}) + "\n" for d in documents))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(documents, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    directory = out / "llama"
    import transformers

    with library_bars(transformers):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return corpus, directory


def sample(directory: Path, prompt: str, tokens: int = 16) -> str:
    """``prompt`` continued greedily (no 2-gram twice) by the model saved in ``directory``,
    loaded with ``from_pretrained`` alone (offline), as a user would."""
    import transformers

    with library_bars(transformers):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True
        ).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=tokens,
            do_sample=False,
            no_repeat_ngram_size=2,  # greedy decoding of a small model repeats itself
            pad_token_id=tokenizer.eos_token_id,
        )
    return str(tokenizer.decode(out[0], skip_special_tokens=True))
