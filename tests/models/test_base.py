"""Tests of pipeswap/models/base.py: LayeredModel's stages, loss and example batches."""

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel


def _toy(task: str = "classify") -> LayeredModel:
    torch.manual_seed(0)
    blocks = [("flat", nn.Flatten()), ("fc1", nn.Linear(3 * 4 * 4, 8)), ("fc2", nn.Linear(8, 5))]
    return LayeredModel("toy", blocks, task, num_classes=5)


def test_stages_share_parameters_and_compose_to_the_whole() -> None:
    model = _toy()
    images, labels = model.example_batch(2, image_size=4, seed=1)
    first, second = model.stage(0, 2), model.stage(2, 3)
    assert first.fc1 is model.fc1
    assert torch.equal(second(first(images)), model(images))
    assert model.layer_names == ["flat", "fc1", "fc2"]
    assert labels.shape == (2,) and int(labels.max()) < 5


def test_loss_is_cross_entropy_for_each_task() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    model = _toy()
    assert torch.allclose(
        model.loss(logits, torch.tensor([0])),
        nn.functional.cross_entropy(logits, torch.tensor([0])),
    )
    lm = LayeredModel("lm", [("id", nn.Identity())], "lm", vocab_size=3)
    tokens, targets = lm.example_batch(2, seq_len=4, seed=0)
    assert tokens.shape == targets.shape == (2, 4)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # targets are the next tokens
    out = torch.zeros(2, 4, 3)
    assert torch.isclose(lm.loss(out, targets), torch.log(torch.tensor(3.0)))


def test_example_batches_are_seeded_and_work_on_meta() -> None:
    model = _toy()
    a, _ = model.example_batch(2, image_size=4, seed=3)
    b, _ = model.example_batch(2, image_size=4, seed=3)
    assert torch.equal(a, b)
    meta, _ = model.example_batch(2, image_size=4, device="meta")
    assert meta.device.type == "meta" and meta.shape == (2, 3, 4, 4)


def test_bad_task_and_missing_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="task"):
        LayeredModel("x", [("id", nn.Identity())], "segment")
    with pytest.raises(PipeswapError, match="image_size"):
        _toy().example_batch(2)


def test_dotted_layer_names_load_their_state_strictly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from pipeswap.models.load import load_user_model
    from tests.models.hf_configs import save_config

    model = load_user_model(save_config(tmp_path / "gpt", "gpt2"), seed=0)
    other = load_user_model(save_config(tmp_path / "gpt", "gpt2"), seed=1)
    state = model.state_dict()
    assert any("." in name for name in model.layer_names)  # transformer.h.0, ...
    keys = other.load_state_dict(state)
    assert keys.missing_keys == [] and keys.unexpected_keys == []
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), state.values()))
    with pytest.raises(RuntimeError, match=r"unexpected keys \['extra'\]"):
        other.load_state_dict({**state, "extra": torch.zeros(1)})
    partial = dict(list(state.items())[1:])
    with pytest.raises(RuntimeError, match="missing keys"):
        other.load_state_dict(partial)
    assert other.load_state_dict(partial, strict=False).missing_keys == [next(iter(state))]
