"""pipeswap/models/fits.py: models too large for this machine are refused before any build."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.models.fits import check_fits, memory_bytes, parameter_count
from pipeswap.models.load import load_user_model
from tests.models.hf_configs import hf_config, save_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("layers", [1, 2, 3, 7])
def test_the_count_from_small_copies_is_the_built_model_s(family: str, layers: int) -> None:
    config = hf_config(family, num_hidden_layers=layers)
    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        built = sum(p.numel() for p in cls(config).parameters())
    assert parameter_count(cls, config) == built


def test_a_million_layers_or_a_huge_width_are_refused_in_seconds(tmp_path: Path) -> None:
    # Before: a million layers built for over 60 s; a width of 4e6 crashed the allocator.
    for name, overrides in (("deep", {"n_layer": 1_000_000}), ("wide", {"n_embd": 4_000_000})):
        path = save_config(tmp_path / name, "gpt2")
        raw = json.loads((Path(path) / "config.json").read_text())
        (Path(path) / "config.json").write_text(json.dumps({**raw, **overrides}))
        started = time.perf_counter()
        with pytest.raises(PipeswapError, match=r"parameters: .* of weights alone, more than"):
            load_user_model(path)
        assert time.perf_counter() - started < 20
        meta = load_user_model(path, device="meta") if name == "wide" else None
        assert meta is None or all(p.is_meta for p in meta.parameters())  # estimate still builds


def test_check_fits_names_the_figures() -> None:
    available = memory_bytes(torch.device("cpu"))
    assert available is not None and available > 2**30
    check_fits("small", 1000, 4, torch.device("cpu"))
    with pytest.raises(
        PipeswapError, match="big has 1,000,000,000,000 parameters: 3.64 TiB of weights alone"
    ):
        check_fits("big", 10**12, 4, torch.device("cpu"))
