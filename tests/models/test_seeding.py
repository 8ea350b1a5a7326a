"""pipeswap/models/seeding.py: the same seed gives the same weights; nobody's RNG moves."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.models.seeding import seeded


def _weights(seed: int | None) -> torch.Tensor:
    with seeded(torch.device("cpu"), seed):
        return nn.Linear(8, 8).weight.detach().clone()


def test_a_seed_fixes_the_weights_and_leaves_the_global_generator_alone() -> None:
    state = torch.random.get_rng_state()
    assert torch.equal(_weights(3), _weights(3))
    assert not torch.equal(_weights(3), _weights(4))
    assert torch.equal(state, torch.random.get_rng_state())


def test_no_seed_draws_from_the_global_generator() -> None:
    torch.manual_seed(7)
    first = _weights(None)
    torch.manual_seed(7)
    assert torch.equal(first, _weights(None))


def test_meta_builds_nothing_to_seed() -> None:
    with seeded(torch.device("meta"), 0), torch.device("meta"):
        assert nn.Linear(2, 2).weight.is_meta
