"""Tests of the model zoo registry: names, specs, meta builds, parameter counts, cuts.

Covers: pipeswap/models/registry.py.
"""

import math
from pathlib import Path

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.models import (
    ModelSpec,
    build_model,
    count_parameters,
    model_names,
    model_spec,
    shape_defaults,
)
from pipeswap.models.export import source_module

SMALL = [n for n in model_names() if n.endswith(("-micro", "-tiny")) and n != "vit-tiny"]

# Exact counts of the faithful architectures (tied embeddings, 1000-class heads); they
# equal the reference implementations' (GPT-2 checkpoints, torchvision, timm).
EXACT = {
    "gpt2-small": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "bert-large": 335_174_458,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet152": 60_192_808,
    "vgg16": 138_357_544,
    "vit-tiny": 5_717_416,
    "vit-b16": 86_567_656,
    "vit-l16": 304_326_632,
}


def _batch(model, batch: int = 2):
    spec = model_spec(model.name)
    if spec.task == "lm":
        return model.example_batch(batch, seq_len=16)
    return model.example_batch(batch, image_size=spec.default_image_size)


def test_names_cover_the_zoo() -> None:
    names = model_names()
    assert len(names) == len(set(names))
    for expected in (
        "gpt2-tiny",
        "gpt2-small",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "bert-tiny",
        "bert-base",
        "bert-large",
        "resnet18",
        "resnet50",
        "resnet101",
        "resnet152",
        "vgg16",
        "vit-tiny",
        "vit-b16",
        "vit-l16",
        "gpt2-micro",
        "bert-micro",
        "resnet-micro",
        "vgg-micro",
        "vit-micro",
    ):
        assert expected in names


def test_unknown_name_lists_known_and_close_names() -> None:
    with pytest.raises(PipeswapError) as info:
        build_model("resnet-50")
    message = str(info.value)
    assert "did you mean resnet50" in message
    assert all(name in message for name in model_names())
    with pytest.raises(PipeswapError):
        model_spec("gpt3")


@pytest.mark.parametrize("name", model_names())
def test_meta_build_and_forward_at_default_sizes(name: str) -> None:
    spec = model_spec(name)
    model = build_model(name, device="meta")
    assert model.name == name and model.task == spec.task
    assert all(p.device.type == "meta" for p in model.parameters())
    tokens, target = model.example_batch(
        spec.default_batch,
        seq_len=spec.default_seq_len,
        image_size=spec.default_image_size,
        device="meta",
    )
    out = model(tokens)
    if spec.task == "lm":
        assert spec.default_seq_len is not None and spec.max_seq_len is not None
        assert spec.default_seq_len <= spec.max_seq_len
        assert out.shape == (spec.default_batch, spec.default_seq_len, spec.vocab_size)
    else:
        assert out.shape == (spec.default_batch, spec.num_classes)
    assert model.loss(out, target).shape == ()


@pytest.mark.parametrize("name", [n for n in model_names() if model_spec(n).published_params])
def test_parameter_count_within_one_percent_of_published(name: str) -> None:
    published = model_spec(name).published_params
    assert published is not None
    count = count_parameters(build_model(name, device="meta"))
    assert abs(count - published) <= 0.01 * published, (count, published)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_parameter_counts(name: str) -> None:
    assert count_parameters(build_model(name, device="meta")) == EXACT[name]


def test_bert_large_against_the_rounded_340m() -> None:
    # Devlin et al. quote 340M; no variant of the checkpoint is within 1% of it (the
    # pooler would add 1.05M: 336.2M, -1.1%), so the spec cites Megatron-LM's 336M.
    count = count_parameters(build_model("bert-large", device="meta"))
    assert 0.985 * 340e6 < count < 340e6


@pytest.mark.parametrize("name", SMALL)
def test_small_models_forward_backward_on_cpu(name: str) -> None:
    model = build_model(name)
    inputs, target = _batch(model)
    out = model(inputs)
    spec = model_spec(name)
    if spec.task == "lm":
        assert out.shape == (2, 16, spec.vocab_size)
        # Small random init: the loss starts near uniform, ln(V).
        assert model.loss(out, target).item() == pytest.approx(math.log(spec.vocab_size), 0.05)
    else:
        assert out.shape == (2, spec.num_classes)
    loss = model.loss(out, target)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", SMALL)
def test_every_stage_cut_reproduces_the_whole_model(name: str) -> None:
    model = build_model(name)
    inputs, _ = _batch(model)
    with torch.no_grad():
        whole = model(inputs)
        for cut in range(1, len(model)):
            front = model.stage(0, cut)(inputs)
            assert torch.equal(model.stage(cut, len(model))(front), whole), cut


def test_layer_names_of_each_family() -> None:
    assert build_model("gpt2-tiny", device="meta").layer_names == [
        "embed",
        "block0",
        "block1",
        "block2",
        "block3",
        "head",
    ]
    assert build_model("bert-micro", device="meta").layer_names == [
        "embed",
        "layer0",
        "layer1",
        "head",
    ]
    assert build_model("resnet-micro", device="meta").layer_names == [
        "stem",
        "layer1_0",
        "layer1_1",
        "layer2_0",
        "layer2_1",
        "head",
    ]
    assert build_model("vit-micro", device="meta").layer_names == [
        "embed",
        "block0",
        "block1",
        "head",
    ]
    assert len(build_model("gpt2-xl", device="meta")) == 50
    assert len(build_model("resnet152", device="meta")) == 1 + 3 + 8 + 36 + 3 + 1


def test_builds_are_seeded_and_leave_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_model("gpt2-micro", seed=7)
    assert torch.equal(torch.rand(3), expected)
    b = build_model("gpt2-micro", seed=7)
    c = build_model("gpt2-micro", seed=8)
    pairs = list(zip(a.parameters(), b.parameters(), c.parameters()))
    assert all(torch.equal(pa, pb) for pa, pb, _ in pairs)
    assert not torch.equal(pairs[0][0], pairs[0][2])


def test_dtype_and_argument_checks() -> None:
    model = build_model("gpt2-micro", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.head.lm.weight is model.embed.tokens.weight
    # The same weights as the float32 build, rounded.
    reference = build_model("gpt2-micro")
    assert all(
        torch.equal(p, q.bfloat16()) for p, q in zip(model.parameters(), reference.parameters())
    )
    with pytest.raises(PipeswapError, match="floating-point"):
        build_model("gpt2-micro", dtype=torch.int64)
    with pytest.raises(PipeswapError, match="tie_embeddings"):
        build_model("resnet-micro", tie_embeddings=False)
    with pytest.raises(PipeswapError, match="image_size"):
        build_model("gpt2-micro", image_size=64)


def test_model_spec_json_round_trip() -> None:
    for name in model_names():
        spec = model_spec(name)
        obj = spec.to_json()
        assert obj["format"] == "pipeswap.modelspec/1"
        assert ModelSpec.from_json(obj) == spec
    with pytest.raises(PipeswapError, match="format"):
        ModelSpec.from_json({**model_spec("vgg16").to_json(), "format": "other/1"})


def test_shape_defaults_fill_in_the_zoo_defaults() -> None:
    gpt = model_spec("gpt2-tiny")
    assert shape_defaults("gpt2-tiny", None, 64) == (gpt.default_seq_len, None)
    assert shape_defaults("gpt2-tiny", 16, None) == (16, None)
    vit = model_spec("vit-micro")
    assert shape_defaults("vit-micro", 128, None) == (None, vit.default_image_size)
    assert shape_defaults("vit-micro", None, 48) == (None, 48)
    with pytest.raises(PipeswapError, match="unknown model"):
        shape_defaults("gpt3", None, None)


def test_a_directory_of_the_user_s_named_like_a_zoo_model_is_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model gpt2-micro`` where ./gpt2-micro holds the user's saved model trains theirs,
    not the built-in one; a missing path says it is missing, not an unknown zoo name."""
    pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    zoo_micro, zoo_tiny = model_spec("gpt2-micro"), model_spec("gpt2-tiny")
    monkeypatch.chdir(tmp_path)
    save_model(tmp_path / "gpt2-micro", "llama")
    assert model_spec("gpt2-micro") != zoo_micro
    assert "LlamaForCausalLM" in repr(source_module(build_model("gpt2-micro", device="meta")))
    (tmp_path / "gpt2-tiny").mkdir()  # a folder of the user's, no model in it: the zoo's
    assert model_spec("gpt2-tiny") == zoo_tiny
    with pytest.raises(PipeswapError, match="there is no model directory models/nope"):
        model_spec("models/nope")
