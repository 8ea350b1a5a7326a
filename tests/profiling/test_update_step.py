"""pipeswap/profiling/update_step.py: an update's cost, over the parameters, put back."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.profiling.meter import StorageMeter
from pipeswap.profiling.update_step import (
    put_back_afterwards,
    update_seconds,
    update_temporaries,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))


def test_an_update_measured_leaves_values_and_gradients_as_they_were() -> None:
    model = _model()
    params = list(model.parameters())
    params[0].grad = torch.ones_like(params[0])
    before = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    cpu = torch.device("cpu")
    assert update_seconds(params, "adamw", cpu, warmup=1, repeats=2) > 0
    assert update_temporaries(params, "adamw", cpu) >= 0
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # bit for bit
    assert all(p.grad is g for p, g in zip(params, grads))  # the same objects, or None


def test_an_update_measured_holds_no_copy_of_the_parameters_on_the_device() -> None:
    model = _model()
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    with StorageMeter("cpu", holding=(model,)) as meter:
        update_seconds(params, "adamw", torch.device("cpu"), warmup=0, repeats=1)
    # Parameters, gradients, AdamW's two states and its temporaries (about one more): the
    # host copy that puts the values back is no device's; stand-ins would add a sixth.
    assert 4 * nbytes <= meter.peak <= 5.2 * nbytes


def test_inside_aliases_of_the_parameters_have_gradients_to_step_on() -> None:
    params = list(_model().parameters())
    before = params[0].detach().clone()
    version = params[0]._version
    with put_back_afterwards(params) as aliases:
        assert all(a.grad is not None and torch.all(a.grad == 1e-3) for a in aliases)
        torch.optim.SGD(aliases, lr=1.0).step()
        assert torch.equal(params[0].detach(), before - 1e-3)  # the step took, in place
    assert torch.equal(params[0].detach(), before)
    assert all(p.grad is None for p in params)
    assert params[0]._version == version  # autograd's record of the parameter untouched
