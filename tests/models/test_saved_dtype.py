"""A model directory saved in bfloat16 (or float16) is saved back in it after training.

Covers: pipeswap/models/saved_dtype.py and its use in pipeswap/models/export.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeswap.models.export import export_model, load_saved
from pipeswap.models.saved_dtype import cast_state, source_dtype
from tests.models.hf_configs import hf_config

transformers = pytest.importorskip("transformers")


def _gpt2(directory: Path, dtype: torch.dtype) -> str:
    """A tied GPT-2 saved in ``dtype``, as a user's directory holds it."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config("gpt2")).to(dtype)
    model.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_directory_is_saved_back_in_its_precision(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    source = _gpt2(tmp_path / "in", dtype)
    assert source_dtype(source) == dtype
    # pipeswap trains float32 master weights (models/load.py reads them so).
    trained = transformers.GPT2LMHeadModel.from_pretrained(
        source, local_files_only=True, dtype=torch.float32
    )
    with torch.no_grad():
        trained.transformer.h[0].mlp.c_fc.weight.add_(0.01)  # a step's worth of change
    export_model(trained, str(tmp_path / "out"), source=source, steps=1)
    saved = load_saved(str(tmp_path / "out"))
    want = trained.state_dict()
    assert all(t.dtype == dtype for t in saved.values())
    assert saved.keys() <= want.keys() and "transformer.wte.weight" in saved
    for name, tensor in saved.items():  # each weight, rounded once to the directory's dtype
        assert torch.equal(tensor, want[name].to(dtype)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", local_files_only=True)
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()  # tied
    assert back.transformer.wte.weight.dtype == dtype


def test_a_float32_directory_or_a_module_of_the_user_s_is_saved_as_trained(
    tmp_path: Path,
) -> None:
    source = _gpt2(tmp_path / "in", torch.float32)
    assert source_dtype(source) is None
    assert source_dtype(str(tmp_path / "nowhere")) is None
    model = transformers.GPT2LMHeadModel(hf_config("gpt2"))
    state = cast_state(model, torch.bfloat16)
    tied = ("transformer.wte.weight", "lm_head.weight")
    assert state[tied[0]] is state[tied[1]]  # one cast for a tied pair
