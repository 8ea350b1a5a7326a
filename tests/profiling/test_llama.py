"""A Hugging Face Llama (built from a small config, nothing downloaded): estimate vs measure."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.models.base import LayeredModel
from pipeswap.profiling.estimate import estimate, meta_copy
from pipeswap.profiling.measure import measure

transformers = pytest.importorskip("transformers")

VOCAB = 256


class _Embed(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class _Decoder(nn.Module):
    """One decoder layer, called with the position embeddings of the model's rotary module;
    with ``masked`` also with an explicit causal mask (Llama then repeats the K/V heads)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, masked: bool) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.masked = masked

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        seq = hidden.shape[1]
        positions = torch.arange(seq, device=hidden.device)[None]  # [1, T]
        mask = None
        if self.masked:
            mask = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).tril()[None, None]
        out = self.layer(
            hidden, attention_mask=mask, position_embeddings=self.rotary(hidden, positions)
        )
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _llama(kv_heads: int, masked: bool = False) -> LayeredModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    llama = transformers.LlamaForCausalLM(config)
    inner = llama.model
    blocks: list[tuple[str, nn.Module]] = [("embed", _Embed(inner.embed_tokens))]
    blocks += [
        (f"layer{i}", _Decoder(layer, inner.rotary_emb, masked))
        for i, layer in enumerate(inner.layers)
    ]
    blocks.append(("head", _Head(inner.norm, llama.lm_head)))
    return LayeredModel("llama", blocks, "lm", vocab_size=VOCAB)


@pytest.mark.parametrize(
    "kv_heads, masked",
    [(8, False), (2, False), (2, True)],
    ids=["multi-head", "grouped-query", "grouped-query-with-mask"],
)
def test_meta_estimate_agrees_with_a_cpu_measurement(kv_heads: int, masked: bool) -> None:
    batch, seq = 2, 64
    model = _llama(kv_heads, masked)
    measured = measure(model, batch, seq_len=seq, warmup=0, repeats=1)
    estimated = estimate(meta_copy(model), batch, seq_len=seq)
    for real, meta in zip(measured.layers, estimated.layers, strict=True):
        assert meta.saved_bytes == real.saved_bytes, real.name
        assert [s.bytes for s in meta.saved] == [s.bytes for s in real.saved], real.name
        assert meta.output_bytes == real.output_bytes, real.name
    peak, estimated_peak = measured.peak_training_bytes(), estimated.peak_training_bytes()
    assert abs(estimated_peak - peak) <= 0.01 * peak


def test_grouped_query_attention_saves_the_smaller_keys_and_values() -> None:
    # K and V of 2 heads, not repeated to 8: each is a quarter of Q, as a CPU run saves.
    batch, seq, head_dim = 2, 64, 64 // 8
    estimated = estimate(meta_copy(_llama(2)), batch, seq_len=seq)
    sizes = [s.bytes for s in estimated.layer("layer0").saved]
    kv_bytes = batch * 2 * seq * head_dim * 4
    assert sizes.count(kv_bytes) >= 2
    assert max(sizes) < batch * 8 * seq * seq * 4  # no T x T attention matrix is kept
