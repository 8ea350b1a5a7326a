"""pipeswap/models/fits.py: models too large for this machine are refused before any build."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.models import fits
from pipeswap.models.fits import (
    MAX_BLOCKS,
    check_depth,
    check_fits,
    depths,
    memory_bytes,
    parameter_count,
)
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


@pytest.mark.parametrize("stages", [[1, 1], [3, 1], [0, 4], [5, 7]])
def test_a_convolutional_net_is_counted_stage_by_stage(stages: list[int]) -> None:
    config = hf_config("resnet", depths=stages)
    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        built = sum(p.numel() for p in cls(config).parameters())
    assert parameter_count(cls, config) == built
    assert sum(depths(config).values()) == sum(stages)


def _deep(tmp_path: Path, name: str, family: str, **overrides: object) -> str:
    path = save_config(tmp_path / name, family)
    raw = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**raw, **overrides}))
    return path


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_million_layers_are_refused_before_any_build_naming_the_size(
    tmp_path: Path, device: str
) -> None:
    # Before: a million layers built for over 60 s, on the meta device too (profile
    # --estimate, plan --estimate, and reading a user model's defaults).
    for name, family, overrides, field in (
        ("deep", "gpt2", {"n_layer": 10**6}, "n_layer 1,000,000"),
        ("stages", "resnet", {"depths": [1, 10**6]}, r"depths\[1\] 1,000,000"),
    ):
        path = _deep(tmp_path, name, family, **overrides)
        started = time.perf_counter()
        with pytest.raises(PipeswapError, match=rf"has 1,00\d,\d+ blocks \({field}\): [\d,]+ "):
            load_user_model(path, device=device)
        assert time.perf_counter() - started < 5
    with pytest.raises(PipeswapError) as refused:
        load_user_model(_deep(tmp_path, "gpt", "gpt2", n_layer=10**6), device=device)
    assert str(refused.value).endswith(
        "gpt has 1,000,000 blocks (n_layer 1,000,000): 12,704,010,304 parameters, 47.33 GiB of "
        f"weights at 4 bytes each; pipeswap builds models of at most {MAX_BLOCKS:,} blocks "
        "(each takes about a millisecond to build, even on the meta device, and then to "
        "profile and plan): lower n_layer in its config.json"
    )


def test_the_deepest_model_allowed_is_built(tmp_path: Path) -> None:
    config = hf_config("resnet", depths=[MAX_BLOCKS - 1, 1])
    check_depth("ok", config, 1, 4)
    with pytest.raises(PipeswapError, match="has 4,097 blocks"):
        check_depth("deep", hf_config("resnet", depths=[MAX_BLOCKS, 1]), 1, 4)


def test_a_huge_width_is_refused_on_a_device_and_estimated_on_meta(tmp_path: Path) -> None:
    # Before: a width of 4e6 crashed the allocator.
    path = _deep(tmp_path, "wide", "gpt2", n_embd=4_000_000)
    started = time.perf_counter()
    with pytest.raises(PipeswapError, match=r"parameters: .* of weights alone, more than"):
        load_user_model(path)
    assert time.perf_counter() - started < 20
    meta = load_user_model(path, device="meta")
    assert all(p.is_meta for p in meta.parameters())  # an estimate still builds


def test_memory_is_the_least_of_the_machine_and_its_cgroup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    physical = memory_bytes(torch.device("cpu"))
    assert physical is not None
    monkeypatch.setattr(fits, "_cgroup_limits", lambda: [2**30])
    assert memory_bytes(torch.device("cpu")) == min(physical, 2**30)


def test_check_fits_names_the_figures() -> None:
    available = memory_bytes(torch.device("cpu"))
    assert available is not None and available > 2**30
    check_fits("small", 1000, 4, torch.device("cpu"))
    with pytest.raises(
        PipeswapError, match="big has 1,000,000,000,000 parameters: 3.64 TiB of weights alone"
    ):
        check_fits("big", 10**12, 4, torch.device("cpu"))
