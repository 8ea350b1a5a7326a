"""Layer checks, boundary specs and tuple transport between stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import pipeline_run

from pipeswap.errors import PipeswapError
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.stage import inspect_layers
from tests.models.hf_configs import save_model


def test_gpt_boundaries_and_flops() -> None:
    config = pipeline_run("gpt2-micro", (1, 1, 1, 1), batch=4, seq_len=16)
    infos = inspect_layers(config)
    assert [i.name for i in infos] == ["embed", "block0", "block1", "head"]
    assert infos[0].output.tensors[0].shape == (4, 16, 32)
    assert infos[0].output.grad_indices == (0,)
    assert infos[1].forward_flops > 0
    assert infos[0].param_bytes == (256 + 64) * 32 * 4


def test_tuple_boundary_carries_an_integer_mask() -> None:
    config = pipeline_run("pipeline_toys:toy_tuple", (2, 2), batch=4, image_size=8)
    infos = inspect_layers(config)
    spec = infos[1].output
    assert spec.is_tuple and [t.dtype for t in spec.tensors] == [torch.float32, torch.int64]
    assert spec.grad_indices == (0,)
    result = Emulator(config.__class__(**{**config.__dict__, "steps": 2})).run()
    assert len(result.losses) == 2 and all(x == x for x in result.losses)


def test_layer_returning_a_dict_is_named() -> None:
    config = pipeline_run("pipeline_toys:toy_dict", (1, 2), batch=4, image_size=8)
    with pytest.raises(
        PipeswapError, match="layer 'as_dict' of pipeline_toys:toy_dict returns dict"
    ):
        inspect_layers(config)


def test_fewer_layers_than_stages() -> None:
    config = pipeline_run("gpt2-micro", (1, 1, 1, 1, 1), batch=4, seq_len=16)
    with pytest.raises(PipeswapError, match="4 layers .* fewer than the 5 stages"):
        inspect_layers(config)


def test_a_mixture_of_experts_is_inspected_on_meta(tmp_path: Path) -> None:
    # Its experts run torch's grouped_mm, whose meta kernel takes bfloat16 only
    # (pipeswap.models.meta_ops): the layers run on meta as on the CPU.
    path = save_model(tmp_path / "mixtral", "mixtral")
    infos = inspect_layers(pipeline_run(path, (2, 2), batch=4, seq_len=16))
    assert [i.name for i in infos] == ["embed", "model.layers.0", "model.layers.1", "head"]
    assert infos[1].output.tensors[0].shape == (4, 16, 32)
