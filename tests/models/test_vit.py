"""Tests of the Vision Transformer family (pipeswap.models.vit).

Covers: pipeswap/models/vit.py.
"""

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.models import build_model


def test_published_shapes() -> None:
    tiny = build_model("vit-tiny", device="meta")
    assert tiny.embed.positions.shape == (1, 1 + 14 * 14, 192)
    assert tiny.block0.attn.heads == 3 and len(tiny) == 14
    large = build_model("vit-l16", device="meta")
    assert large.block0.mlp.fc.out_features == 4096 and len(large) == 26


def test_image_size_sizes_the_position_grid() -> None:
    model = build_model("vit-micro", image_size=64)
    assert model.embed.positions.shape == (1, 1 + 8 * 8, 32)
    assert model(torch.rand(2, 3, 64, 64)).shape == (2, 10)


def test_other_sizes_interpolate_positions() -> None:
    model = build_model("vit-micro")
    embed = model.embed
    assert torch.equal(embed._positions(4, 4), embed.positions)
    assert embed._positions(6, 8).shape == (1, 1 + 48, 32)
    assert model(torch.rand(2, 3, 48, 64)).shape == (2, 10)


def test_sizes_must_be_multiples_of_the_patch() -> None:
    model = build_model("vit-micro")
    with pytest.raises(PipeswapError, match="multiple of the patch size 8"):
        model(torch.rand(1, 3, 36, 36))
    with pytest.raises(PipeswapError, match="multiple of the patch size 16"):
        build_model("vit-b16", device="meta", image_size=200)
