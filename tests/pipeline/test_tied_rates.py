"""pipeswap/pipeline/tied_rates.py: a tied copy's rates move as its stage's own do."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.pipeline.tied_rates import built_rates, followed_rates


def _sgd(*rates: float) -> torch.optim.Optimizer:
    groups = [{"params": [nn.Parameter(torch.zeros(1))], "lr": r} for r in rates]
    return torch.optim.SGD(groups, lr=rates[0])


def test_a_copy_s_rates_are_its_built_ones_moved_by_the_own_first_rate_s_factor() -> None:
    own, copy = _sgd(0.01, 0.02), _sgd(0.04, 0.001)
    torch.optim.lr_scheduler.LambdaLR(own, lambda t: 0.25)  # a warm-up's first factor
    assert built_rates(own) == [0.01, 0.02] and own.param_groups[0]["lr"] == 0.0025
    assert followed_rates(copy, built_rates(copy), own, built_rates(own)) == [0.01, 0.00025]


def test_without_rates_of_its_own_a_stage_s_copy_keeps_its_optimizer_s() -> None:
    copy = _sgd(0.04)
    copy.param_groups[0]["lr"] = 0.03
    assert built_rates(None) == []
    assert followed_rates(copy, [0.04], None, []) == [0.03]
    assert followed_rates(copy, [0.04], _sgd(0.0), [0.0]) == [0.03]  # no factor to take
