"""A Hugging Face Llama on text files, as a user brings them: a model directory and --data."""

from __future__ import annotations

from pathlib import Path

from pipeline_convergence import Task

LLAMA_DIR = Path("/tmp/pipeswap-robustness")


def llama_task(steps: int) -> Task:
    """A Hugging Face LlamaForCausalLM (8 layers, hidden 64, bytes) saved under LLAMA_DIR."""
    return Task(
        "llama",
        str(LLAMA_DIR / "llama-8x64"),
        10,
        batch=16,
        steps=steps,
        lr_sgd=0.05,
        lr_adam=1e-3,
        seq_len=32,
    )


def write_llama() -> None:
    """The Llama's model directory and its text files (train and held-out), once."""
    import torch
    import transformers

    from pipeswap.data import stdlib_corpus

    folder = LLAMA_DIR / "llama-8x64"
    if not (folder / "config.json").exists():
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for split in ("train", "val"):
        path = LLAMA_DIR / f"{split}.txt"
        if not path.exists():
            path.write_bytes(stdlib_corpus(2_000_000 if split == "train" else 200_000, split))
