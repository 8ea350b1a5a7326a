"""Tests of the GPT-2 family (pipeswap.models.gpt).

Covers: pipeswap/models/transformer.py.
"""

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models import build_model, count_parameters, model_spec


def test_gpt2_tiny_shape() -> None:
    spec = model_spec("gpt2-tiny")
    assert (spec.vocab_size, spec.max_seq_len) == (256, 256)
    model = build_model("gpt2-tiny")
    assert model.embed.tokens.weight.shape == (256, 64)
    assert len(model) == 6
    block = model.block0
    assert block.attn.heads == 4 and block.mlp.fc.out_features == 256
    assert block.mlp.act.approximate == "tanh"
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_published_shapes() -> None:
    for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        spec = model_spec(name)
        assert (spec.vocab_size, spec.max_seq_len, spec.default_seq_len) == (50257, 1024, 1024)


def test_attention_is_causal() -> None:
    model = build_model("gpt2-micro")
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_tied_and_untied_heads() -> None:
    tied = build_model("gpt2-micro")
    untied = build_model("gpt2-micro", tie_embeddings=False)
    assert tied.head.lm.weight is tied.embed.tokens.weight
    assert untied.head.lm.weight is not untied.embed.tokens.weight
    assert count_parameters(untied) == count_parameters(tied) + 256 * 32
    # Untied copies start equal: the two models compute the same function.
    tokens, _ = tied.example_batch(2, seq_len=10)
    with torch.no_grad():
        assert torch.equal(tied(tokens), untied(tokens))


def test_sequence_longer_than_context_is_refused() -> None:
    model = build_model("gpt2-micro")
    with pytest.raises(PipeswapError, match="context of 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(PipeswapError, match="context of 1024"):
        small = build_model("gpt2-small", device="meta")
        small(torch.empty(1, 2048, dtype=torch.long, device="meta"))


def test_gradients_are_deterministic() -> None:
    def grads() -> list[torch.Tensor]:
        model = build_model("gpt2-tiny", tie_embeddings=False)
        tokens, target = model.example_batch(4, seq_len=32)
        model.loss(model(tokens), target).backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(), grads()))
