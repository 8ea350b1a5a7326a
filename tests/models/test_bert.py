"""Tests of the BERT family (pipeswap.models.bert)."""

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models import build_model, count_parameters, model_spec


def test_layers_are_post_norm_with_exact_gelu() -> None:
    model = build_model("bert-micro")
    assert model.layer_names == ["embed", "layer0", "layer1", "head"]
    assert model.layer0.mlp.act.approximate == "none"
    assert model.layer0.ln1.eps == 1e-12
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    # Post-LN: every layer's output is normalised (zero mean per position).
    with torch.no_grad():
        hidden = model.stage(0, 2)(model.example_batch(2, seq_len=8)[0])
    assert hidden.mean(-1).abs().max() < 1e-5


def test_attention_is_bidirectional() -> None:
    model = build_model("bert-micro")
    tokens = torch.arange(10).unsqueeze(0)
    changed = tokens.clone()
    changed[0, 9] = 200
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[:, 0], model(changed)[:, 0])


def test_decoder_tied_to_token_embeddings() -> None:
    tied = build_model("bert-micro")
    assert tied.head.decoder.weight is tied.embed.tokens.weight
    untied = build_model("bert-micro", tie_embeddings=False)
    assert count_parameters(untied) == count_parameters(tied) + 256 * 32


def test_published_shapes_and_limits() -> None:
    base = build_model("bert-base", device="meta")
    assert base.embed.tokens.weight.shape == (30522, 768)
    assert model_spec("bert-large").max_seq_len == 512
    with pytest.raises(PipeswapError, match="512 positions"):
        base(torch.empty(1, 513, dtype=torch.long, device="meta"))
