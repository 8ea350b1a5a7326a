"""Tests of the Profile contract (pipeswap.profiling.profile)."""

import dataclasses
import random
from collections.abc import Callable

import pytest
from support import toy_profile

from pipeswap.errors import PipeswapError
from pipeswap.profiling.profile import LayerProfile, Profile, SavedTensor


def _profile() -> Profile:
    layers = (
        LayerProfile("embed", 0.001, 0.002, 100, 40, (SavedTensor(0, 40),)),
        LayerProfile("block0", 0.01, 0.02, 1000, 40, (SavedTensor(0, 40), SavedTensor(1, 80)), 64),
    )
    return Profile(
        "toy",
        4,
        "float32",
        "measured",
        "cpu",
        "adam",
        2200,
        layers,
        seq_len=8,
        optimizer_step_s=0.003,
    )


def test_totals_and_peak() -> None:
    p = _profile()
    assert p.param_bytes == 1100
    assert p.saved_bytes == 160
    assert p.resident_bytes == 2 * 1100 + 2200
    assert p.peak_training_bytes() == 4400 + 160 + (64 + 40)


def test_a_slowed_profile_scales_compute_and_nothing_else() -> None:
    p = _profile()
    slow = p.slowed(2.5, "2.50x: 2 ranks at once")
    assert slow.forward_s == pytest.approx(2.5 * p.forward_s)
    assert slow.backward_s == pytest.approx(2.5 * p.backward_s)
    assert slow.optimizer_step_s == pytest.approx(2.5 * 0.003)  # the update computes too
    assert slow.peak_training_bytes() == p.peak_training_bytes()
    assert slow.notes["compute_slowdown"] == "2.50x: 2 ranks at once"


def test_json_round_trip(tmp_path) -> None:
    p = _profile()
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p
    untimed = dataclasses.replace(p, optimizer_step_s=None)
    assert "optimizer_step_s" not in untimed.to_json()
    assert Profile.from_json(untimed.to_json()) == untimed


def test_a_negative_optimizer_step_is_refused() -> None:
    obj = {**_profile().to_json(), "optimizer_step_s": -1}
    with pytest.raises(PipeswapError, match="optimizer_step_s is -1; write a finite number"):
        Profile.from_json(obj)


def test_contract_example_is_accepted() -> None:
    obj = {
        "format": "pipeswap.profile/1",
        "model": "gpt2-tiny",
        "batch": 8,
        "seq_len": 64,
        "dtype": "float32",
        "source": "measured",
        "device": "cpu",
        "optimizer": "adam",
        "optimizer_state_bytes": 1048576,
        "layers": [
            {
                "name": "embed",
                "forward_s": 0.0011,
                "backward_s": 0.0020,
                "param_bytes": 524288,
                "output_bytes": 131072,
                "saved": [{"index": 0, "bytes": 131072}],
            }
        ],
    }
    p = Profile.from_json(obj)
    assert p.layers[0].saved == (SavedTensor(0, 131072),)


def test_wrong_format_is_refused() -> None:
    with pytest.raises(PipeswapError, match="pipeswap.profile/1"):
        Profile.from_json({"format": "pipeswap.topology/1"})


# ---- refused inputs: each names the layer and the field ---------------------------------
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("forward_s", float("nan"), r"layer 1 \('block0'\): forward_s is nan; write a finite"),
        ("backward_s", float("inf"), r"layer 1 \('block0'\): backward_s is inf"),
        ("forward_s", -0.5, r"forward_s is -0.5; write a finite number of seconds >= 0"),
        ("forward_s", "fast", r"forward_s is \"fast\""),
        ("param_bytes", -1, r"layer 1 \('block0'\): param_bytes is -1; write a whole number of"),
        ("output_bytes", 1.5, r"output_bytes is 1.5; write a whole number of bytes >= 0"),
        ("workspace_bytes", True, r"workspace_bytes is true"),
        ("saved", [{"index": 0, "bytes": -8}], r"saved\[0\]: bytes is -8"),
        ("saved", "all", r"saved is \"all\"; write a JSON list"),
    ],
)
def test_bad_layer_fields_are_named(field: str, value: object, message: str) -> None:
    obj = _profile().to_json()
    obj["layers"][1][field] = value
    with pytest.raises(PipeswapError, match=message):
        Profile.from_json(obj, where="p.json")


def test_whole_float_byte_counts_are_accepted() -> None:
    obj = _profile().to_json()
    obj["layers"][1]["param_bytes"] = 1000.0  # 1e3 written as a float by another tool
    assert Profile.from_json(obj).layers[1].param_bytes == 1000


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("batch", 0, r"batch is 0; write a whole number >= 1"),
        ("model", None, r"model is null; write a string"),
        ("layers", {}, r"layers is \{\}; write a JSON list"),
        ("seq_len", -4, r"seq_len is -4"),
        ("notes", [], r"notes is \[\]; write a JSON object"),
        ("has_saved_data", "yes", r"has_saved_data is \"yes\"; write true or false"),
    ],
)
def test_bad_profile_fields_are_named(field: str, value: object, message: str) -> None:
    obj = _profile().to_json()
    obj[field] = value
    with pytest.raises(PipeswapError, match=message):
        Profile.from_json(obj)


def test_fuzzed_profiles_load_or_raise_pipeswap_error(
    mutate: Callable[[object, random.Random], object],
) -> None:
    """Random damage to a valid file is either harmless or a PipeswapError, never a crash."""
    rng = random.Random(20261123)
    valid = _profile().to_json()
    refused = 0
    for _ in range(200):
        mutant = mutate(valid, rng)
        try:
            Profile.from_json(mutant)  # type: ignore[arg-type]
        except PipeswapError:
            refused += 1
    assert refused > 50  # the mutations do reach the checks


def test_repeated_layer_names_are_refused() -> None:
    # Before: accepted, and a plan naming "block" could not say which of the two it meant.
    obj = _profile().to_json()
    obj["layers"][1]["name"] = "embed"
    with pytest.raises(PipeswapError, match=r"layer names repeat \('embed'\); a plan names"):
        Profile.from_json(obj)


def test_scaled_profile_grows_compute_and_activations_not_weights() -> None:
    profile = toy_profile([(1.0, 0.5)] * 3, output_gb=0.25, workspace_bytes=7)
    double = profile.scaled(2)
    assert double.batch == 2 * profile.batch
    assert double.compute_s == 2 * profile.compute_s
    assert double.saved_bytes == 2 * profile.saved_bytes
    assert double.param_bytes == profile.param_bytes
    assert double.optimizer_state_bytes == profile.optimizer_state_bytes
    assert [la.workspace_bytes for la in double.layers] == [14] * 3
    assert profile.scaled(1) == profile
    with pytest.raises(PipeswapError, match="whole factor"):
        profile.scaled(0)


def test_a_saved_index_given_twice_is_refused_naming_the_layer() -> None:
    obj = _profile().to_json()
    layer = next(la for la in obj["layers"] if len(la["saved"]) >= 1)
    layer["saved"].append(dict(layer["saved"][0]))
    with pytest.raises(PipeswapError, match="saved index 0 appears twice"):
        Profile.from_json(obj)


def test_memory_readings_below_the_parameters_are_refused() -> None:
    from pipeswap.step_memory import StepMemory

    profile = _profile()
    n = len(profile.layers)
    zero = StepMemory(0, (0,) * n, 0, (0,) * n, 0, "storages")
    obj = dataclasses.replace(profile, memory=zero).to_json()
    with pytest.raises(PipeswapError, match="memory start_bytes 0 is less than the parameters'"):
        Profile.from_json(obj)
