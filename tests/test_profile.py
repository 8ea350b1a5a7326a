"""Tests of the Profile contract (pipeswap.profile)."""

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.profile import LayerProfile, Profile, SavedTensor


def _profile() -> Profile:
    layers = (
        LayerProfile("embed", 0.001, 0.002, 100, 40, (SavedTensor(0, 40),)),
        LayerProfile("block0", 0.01, 0.02, 1000, 40, (SavedTensor(0, 40), SavedTensor(1, 80)), 64),
    )
    return Profile("toy", 4, "float32", "measured", "cpu", "adam", 2200, layers, seq_len=8)


def test_totals_and_peak() -> None:
    p = _profile()
    assert p.param_bytes == 1100
    assert p.saved_bytes == 160
    assert p.resident_bytes == 2 * 1100 + 2200
    assert p.peak_training_bytes() == 4400 + 160 + (64 + 40)


def test_json_round_trip(tmp_path) -> None:
    p = _profile()
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p


def test_contract_example_is_accepted() -> None:
    obj = {"format": "pipeswap.profile/1", "model": "gpt2-tiny", "batch": 8, "seq_len": 64,
           "dtype": "float32", "source": "measured", "device": "cpu",
           "optimizer": "adam", "optimizer_state_bytes": 1048576,
           "layers": [{"name": "embed", "forward_s": 0.0011, "backward_s": 0.0020,
                       "param_bytes": 524288, "output_bytes": 131072,
                       "saved": [{"index": 0, "bytes": 131072}]}]}
    p = Profile.from_json(obj)
    assert p.layers[0].saved == (SavedTensor(0, 131072),)


def test_wrong_format_is_refused() -> None:
    with pytest.raises(PipeswapError, match="pipeswap.profile/1"):
        Profile.from_json({"format": "pipeswap.topology/1"})
