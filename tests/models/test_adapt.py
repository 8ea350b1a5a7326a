"""pipeswap/models/adapt.py: any nn.Module as a LayeredModel, its task read off the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.adapt import adapt
from tests.models.tiny_lm import TinyLM


def test_a_plain_module_is_cut_at_its_repeated_blocks() -> None:
    torch.manual_seed(0)
    net = TinyLM()
    model = adapt(net, name="tiny")
    assert model.layer_names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(model(ids), net(ids))
    assert model.task == "lm" and model.vocab_size == 256
    assert adapt(model) is model  # a LayeredModel is used as it is


def test_user_named_dotted_blocks_work_and_skipped_layers_are_refused() -> None:
    net = TinyLM()
    ids = torch.randint(0, 256, (2, 8))
    named = adapt(net, blocks=["blocks.0", "blocks.1", "blocks.2"])
    assert named.layer_names[1:4] == ["blocks.0", "blocks.1", "blocks.2"]
    assert torch.equal(named(ids), net(ids))
    with pytest.raises(PipeswapError, match="runs blocks.1.mix between its blocks"):
        adapt(net, blocks=["blocks.0", "blocks.2"])
    with pytest.raises(PipeswapError, match="has no module 'blocks.7'"):
        adapt(net, blocks=["blocks.0", "blocks.7"])


def test_a_sequential_is_cut_at_its_children() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 5))
    model = adapt(net)
    assert model.layer_names == ["0", "1", "2", "3"]
    assert model.task == "classify" and model.num_classes == 5


def test_models_it_cannot_tell_the_task_of_are_refused() -> None:
    with pytest.raises(PipeswapError, match="cannot tell what"):
        adapt(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))


class FixedLengthLM(nn.Module):
    """A user's model that takes only its own sequence length (a mask buffer of that size)."""

    def __init__(self, length: int = 12) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 50)
        self.register_buffer("position", torch.randn(length, 16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.position  # only [*, length]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_model_of_one_length_is_adapted_on_an_input_of_the_user_s() -> None:
    torch.manual_seed(0)
    net = FixedLengthLM()
    with pytest.raises(PipeswapError, match=r"probe input of shape \(1, 8\).*pass example="):
        adapt(net)
    ids = torch.randint(0, 50, (3, 12))
    model = adapt(net, example=ids[:1])
    assert model.layer_names == ["embed", "blocks.0", "blocks.1", "head"]
    assert torch.equal(model(ids), net(ids))


def test_a_pipeline_adapts_the_model_on_its_first_batch() -> None:
    """pipeswap.Pipeline runs the model on the first batch it is handed (its length)."""
    from pipeswap.training.pipe import Pipeline

    torch.manual_seed(0)
    net = FixedLengthLM()
    pipe = Pipeline(net, stages=1, micro_batches=2, optimizer=lambda ps: torch.optim.SGD(ps, 0.1))
    with pytest.raises(PipeswapError, match="from the first pipe.step"):
        _ = pipe.layered
    ids = torch.randint(0, 50, (4, 13))
    first = pipe.step(ids[:, :-1], target=ids[:, 1:])
    assert first is not None and pipe.step(ids[:, :-1], target=ids[:, 1:]) < first
    assert pipe.balance == (4,) and pipe.layered.layer_names[0] == "embed"
    pipe.close()


def _classifier(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    small |= {"intermediate_size": 64, "image_size": 16, "patch_size": 8, "num_labels": 3}
    torch.manual_seed(0)
    if kind == "beit":  # its config has a vocabulary (masked image modelling), 1 channel
        config = transformers.BeitConfig(**small, num_channels=1, drop_path_rate=0.0)
        return transformers.BeitForImageClassification(config)
    # CLIP: a text and a vision config; the classifier reads the vision one's images.
    vision = {**small, "num_channels": 1}
    config = transformers.CLIPConfig(text_config=small, vision_config=vision, num_labels=3)
    return transformers.CLIPForImageClassification(config)


@pytest.mark.parametrize("kind", ["beit", "clip"])
def test_an_image_classifier_reads_images_whatever_else_its_config_has(kind: str) -> None:
    model = _classifier(kind)
    layered = adapt(model)
    assert not layered.takes_tokens
    images = torch.randn(2, 1, 16, 16)  # the vision config's channels and side
    model.eval()
    layered.eval()
    with torch.no_grad():
        assert torch.equal(layered(images), model(pixel_values=images).logits)


def test_a_tokens_model_without_a_vocabulary_size_is_refused_saying_what_to_set() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.CanineConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = transformers.CanineForSequenceClassification(config)
    with pytest.raises(PipeswapError, match="set config.vocab_size"):
        adapt(model)


def test_a_config_without_a_longest_sequence_adapts() -> None:
    """XLNet's max_position_embeddings is -1 (relative positions): no limit, not a length."""
    transformers = pytest.importorskip("transformers")
    config = transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_inner=64)
    torch.manual_seed(0)
    model = transformers.XLNetLMHeadModel(config)
    layered = adapt(model)
    assert layered.max_positions is None
    ids = torch.randint(0, 64, (2, 12))
    model.eval()
    layered.eval()
    with torch.no_grad():
        assert torch.equal(layered(ids), model(input_ids=ids).logits)


class _MaskedLM(TinyLM):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(ids) * mask[..., None]


class _DictLM(TinyLM):
    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"logits": super().forward(ids)}


def test_inputs_and_outputs_it_cannot_replay_are_refused_saying_what_to_write() -> None:
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(PipeswapError, match="example is a tuple: .*one tensor"):
        adapt(TinyLM(), example=(ids, ids))  # type: ignore[arg-type]
    with pytest.raises(PipeswapError, match=r"does not run as model\(example\).*TypeError.*wrap"):
        adapt(_MaskedLM(), example=ids)
    with pytest.raises(PipeswapError, match=r"returns a dict: .*model\(x\)\['logits'\]"):
        adapt(_DictLM())
