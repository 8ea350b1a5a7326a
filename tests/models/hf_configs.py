"""Small Hugging Face configs of every family pipeswap supports, saved as model directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

FAMILIES = ("gpt2", "llama", "bert", "vit", "resnet")


def hf_config(family: str, *, dropout: float = 0.0, **overrides: Any) -> Any:
    """A tiny config of ``family`` (2 blocks, hidden 32); ``dropout`` where it has one."""
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        kwargs = dict(
            vocab_size=256,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
            architectures=["GPT2LMHeadModel"],
        )
        return transformers.GPT2Config(**{**kwargs, **overrides})
    if family == "llama":
        kwargs = dict(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attention_dropout=dropout,
            bos_token_id=0,
            eos_token_id=0,
            architectures=["LlamaForCausalLM"],
        )
        return transformers.LlamaConfig(**{**kwargs, **overrides})
    if family == "bert":
        kwargs = dict(
            vocab_size=260,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            architectures=["BertForMaskedLM"],
        )
        return transformers.BertConfig(**{**kwargs, **overrides})
    if family == "vit":
        kwargs = dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=10,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            architectures=["ViTForImageClassification"],
        )
        return transformers.ViTConfig(**{**kwargs, **overrides})
    if family == "resnet":
        kwargs = dict(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=10,
            architectures=["ResNetForImageClassification"],
        )
        return transformers.ResNetConfig(**{**kwargs, **overrides})
    if family == "rwkv":  # not in FAMILIES: a model that writes its weights in eval mode
        kwargs = dict(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            attention_hidden_size=32,
            intermediate_size=64,
            context_length=32,
            architectures=["RwkvForCausalLM"],
        )
        return transformers.RwkvConfig(**{**kwargs, **overrides})
    # Not in FAMILIES either: mixtures of experts, whose experts transformers runs with
    # torch's grouped_mm (its meta kernel takes bfloat16 only: pipeswap.models.meta_ops).
    if family in ("mixtral", "qwen3_moe"):
        kwargs = dict(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            num_experts_per_tok=2,
            bos_token_id=0,
            eos_token_id=0,
        )
        if family == "mixtral":
            kwargs.update(num_local_experts=4, architectures=["MixtralForCausalLM"])
            return transformers.MixtralConfig(**{**kwargs, **overrides})
        kwargs.update(
            num_experts=4,
            moe_intermediate_size=32,
            head_dim=8,
            architectures=["Qwen3MoeForCausalLM"],
        )
        return transformers.Qwen3MoeConfig(**{**kwargs, **overrides})
    raise ValueError(family)


def save_config(directory: Path, family: str, **kwargs: Any) -> str:
    """Write ``family``'s config (no weights) to ``directory``; return its path as a string."""
    directory.mkdir(parents=True, exist_ok=True)
    hf_config(family, **kwargs).save_pretrained(directory)
    return str(directory)


def save_model(directory: Path, family: str, seed: int = 123, **kwargs: Any) -> str:
    """Write ``family``'s config and seeded random weights to ``directory``."""
    transformers = pytest.importorskip("transformers")
    config = hf_config(family, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return str(directory)


def gpt2_module() -> Any:
    """A Hugging Face GPT-2 (tied, dropout 0.1) for ``--model tests.models.hf_configs:gpt2_module``."""
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(hf_config("gpt2", dropout=0.1))
