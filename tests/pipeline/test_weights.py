"""pipeswap/pipeline/weights.py: a tied copy's late update takes its own step's rate, and
its rates follow its stage's own (pipeswap/pipeline/tied_rates.py);
pipeswap/pipeline/prediction_error.py: the prediction error's ratio."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.prediction_error import PredictionError, finite
from pipeswap.pipeline.weights import StageWeights


# The copy's optimizer steps after the script stepped its scheduler: that is the case.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_tied_copy_applied_after_the_rate_moved_steps_at_its_own_update_s_rate() -> None:
    """On an asynchronous schedule a tied copy applies update t after the stage's
    UPDATE(t), and a user's scheduler may have moved the rate between: the copy steps at
    the rate of UPDATE(t), as the stage's other parameters did."""
    module = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    with torch.no_grad():
        module[0].weight.fill_(0.5)
        module[1].weight.fill_(0.5)
    schedulers: list[torch.optim.lr_scheduler.LambdaLR] = []

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.1)
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 10.0**-t))
        return optimizer

    distances = {(k, 0): 0 for k in ("F", "B")}
    weights = StageWeights(
        module, "stale", distances, {0: 0}, shared={"tied": module[1].weight},
        optimizer_factory=factory, optimizer_config=OptimizerConfig(optimizer="sgd", lr=0.1),
    )  # fmt: skip
    for p in weights.params:
        p.grad = torch.ones_like(p)
    weights.update(0)
    for scheduler in schedulers:  # the script steps its schedulers after the step
        scheduler.step()
    weights.apply_shared("tied", torch.ones(1, 1, dtype=torch.float64), 0)
    own, tied = (float(p.detach()) for p in weights.params)
    assert own == tied == 0.5 - 0.1  # both at step 0's rate, not the next one's (0.01)
    assert schedulers[-1].optimizer.param_groups[0]["lr"] == 0.1 * 0.1  # put back


def test_a_script_keeping_the_last_scheduler_built_moves_every_rate_of_the_stage() -> None:
    """The optimizer function is called for the tied copy too: the last call is the stage's
    own parameters (the scheduler a script keeps), and the copy's rate follows it. Built
    last, the copy's had been the one kept: the stage's own rate stayed at the warm-up's
    first (0.0025 for 0.01 on a GPT-2; losses apart from step 3)."""
    module = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    with torch.no_grad():
        module[0].weight.fill_(0.5)
        module[1].weight.fill_(0.5)
    kept: list[torch.optim.lr_scheduler.LambdaLR] = []
    given: list[int] = []

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        given.append(len(params))
        optimizer = torch.optim.SGD(params, lr=0.2)
        kept[:] = [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.5 ** (t + 1))]
        return optimizer

    distances = {(k, u): 0 for k in ("F", "B") for u in (0, 1)}
    weights = StageWeights(
        module, "stale", distances, {0: 0, 1: 1}, shared={"tied": module[1].weight},
        optimizer_factory=factory, optimizer_config=OptimizerConfig(optimizer="sgd", lr=0.2),
    )  # fmt: skip
    assert given == [1, 1]  # the copy's, then the stage's own (module[0])
    expected = 0.5
    for step, rate in enumerate((0.1, 0.05)):
        for p in weights.params:
            p.grad = torch.ones_like(p)
        weights.update(step)
        weights.apply_shared("tied", torch.ones(1, 1, dtype=torch.float64), step)
        kept[0].step()  # the script's one scheduler, after each step
        expected -= rate
        own, tied = (float(p.detach()) for p in weights.params)
        assert own == tied == pytest.approx(expected, abs=0, rel=1e-15), step


def test_the_ratio_is_the_predicted_over_the_stale_distance() -> None:
    assert PredictionError(used=1.0, stale=4.0, passes=2).ratio == 0.25
    assert PredictionError().ratio is None
    assert finite(math.inf) is None and finite(None) is None and finite(0.5) == 0.5
