"""pipeswap/training/loop_optimizers.py: which optimizer state a loop's budget counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.training.loop_optimizers import given_optimizers, optimizer_name, unseen_state_bytes


def test_an_optimizer_is_named_as_the_state_model_knows_it() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_name(torch.optim.SGD(params, lr=0.1)) == "sgd"
    assert optimizer_name(torch.optim.Adam(params)) == "adam"
    assert optimizer_name(torch.optim.RMSprop(params)) == "adamw"  # two buffers: the safe side


def test_a_given_optimizer_that_makes_no_state_has_none_counted_before_its_first_step() -> None:
    """Plain SGD (no momentum) keeps no buffer: its state stays empty after every step, so
    counted as momentum SGD's before a first step, every plan held one buffer per
    parameter more than the device ever did (13% of a small two-stack model's budget)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    first, second = (sum(p.nbytes for p in layer.parameters()) for layer in model)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mixed = torch.optim.SGD(
        [{"params": model[0].parameters(), "momentum": 0.9}, {"params": model[1].parameters()}],
        lr=0.1,
    )
    adam = torch.optim.Adam(model.parameters())
    assert unseen_state_bytes(model, "sgd", [plain]) == 0
    assert unseen_state_bytes(model, "sgd", [momentum]) == first + second
    assert unseen_state_bytes(model, "sgd", [mixed]) == first
    assert unseen_state_bytes(model, "adam", [adam]) == 2 * (first + second)
    model(torch.ones(1, 8)).sum().backward()
    plain.step()
    assert not plain.state and unseen_state_bytes(model, "sgd", [plain]) == 0


def test_a_model_s_trainable_parameters_in_no_given_optimizer_are_warned_of() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    head = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(RuntimeWarning, match="2 trainable parameters of the model are in no"):
        name, given = given_optimizers(model, head)
    assert (name, given) == ("sgd", [head])
    with pytest.raises(ConfigError, match="is an empty list"):
        given_optimizers(model, [])
