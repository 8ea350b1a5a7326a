"""pipeswap/models/written.py: what an eval forward writes into a model is put back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.base import evaluating
from pipeswap.models.state import inspecting
from pipeswap.models.written import written_back
from tests.models.hf_configs import hf_config


class RescalesInEval(nn.Module):
    """As Hugging Face's RWKV: its first eval forward halves a weight in place and says so
    in a flag; its next training forward doubles it back."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = nn.Linear(4, 4)
        self.scaled = nn.Linear(4, 4)
        self.rescaled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training == self.rescaled:
            with torch.no_grad():
                self.scaled.weight.mul_(0.5 if not self.training else 2.0)
            self.rescaled = not self.training
        return self.scaled(self.kept(x))


@pytest.mark.parametrize("around", [evaluating, inspecting, written_back])
def test_weights_and_flags_an_eval_forward_wrote_come_back(around: object) -> None:
    torch.manual_seed(0)
    model = RescalesInEval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with around(model):  # type: ignore[operator]
        model.eval()
        model(torch.randn(2, 4))
        assert model.rescaled and not torch.equal(model.scaled.weight, before["scaled.weight"])
    assert model.training or around is written_back  # the mode is the others' to restore
    model.train()
    assert model.rescaled is False
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    # The next training step runs on the weights as they were, and writes none of them.
    version = model.scaled.weight._version
    model(torch.randn(2, 4)).sum().backward()
    assert model.scaled.weight._version == version


def test_a_model_that_writes_nothing_is_left_as_it_is() -> None:
    model = nn.Linear(4, 4)
    version = model.weight._version
    with evaluating(model):
        model(torch.randn(2, 4))
    assert model.weight._version == version  # no copy was put back: nothing was written


def test_hugging_face_rwkv_keeps_its_weights_through_adapt() -> None:
    """A refused RWKV (eval mode halves the hidden state between its blocks) used to keep
    the weights its eval forward divided: a loop that went on trained on them."""
    transformers = pytest.importorskip("transformers")
    from pipeswap.models.adapt import adapt

    config = hf_config("rwkv", num_hidden_layers=4, rescale_every=2)
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(config)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(PipeswapError, match="transforms the output of block"):
        adapt(model)
    assert model.rwkv.layers_are_rescaled is False
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
