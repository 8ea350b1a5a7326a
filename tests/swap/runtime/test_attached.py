"""pipeswap/swap/runtime/attached.py: a copy of a model with a plan attached has no plan."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch import nn

from pipeswap.swap.runtime.attached import AttachedHook, own_forward


def test_a_copied_hook_does_nothing_and_the_original_still_runs() -> None:
    calls: list[int] = []
    layer = nn.Linear(2, 2)
    layer.register_forward_pre_hook(AttachedHook(lambda *_: calls.append(1)))
    twin = copy.deepcopy(layer)
    twin(torch.ones(2))
    assert calls == []
    layer(torch.ones(2))
    assert calls == [1]
    again = pickle.loads(pickle.dumps(AttachedHook(lambda *_: calls.append(2))))
    assert again(layer, (torch.ones(2),)) is None and calls == [1]
    buffer = io.BytesIO()
    torch.save(layer, buffer)  # a local closure inside: pickled as a hook that does nothing
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(torch.ones(2)), layer(torch.ones(2))) and calls == [1, 1]


def test_own_forward_is_the_class_forward_bound_to_the_module() -> None:
    layer = nn.Linear(2, 2)
    assert own_forward(layer).__self__ is layer
    assert torch.equal(own_forward(layer)(torch.ones(2)), layer(torch.ones(2)))
