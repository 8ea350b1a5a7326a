"""The delay-scaled learning rate: asynchronous stages step at lr / (1 + tau)^P.

Covers: pipeswap/pipeline/predict.py (delay_lr_scale), pipeswap/pipeline/weights.py
(StageWeights.lr_scale), pipeswap/schedule/pipeline_config.py (delay_lr_power, delay_power),
pipeswap/schedule/modes.py (WeightMode.delay_lr_power). The runtime == emulator equality with the
rule on is in test_runtime.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from support import pipeline_run
from torch import nn

from pipeswap.config_fields import ConfigError, replace_fields
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.predict import delay_lr_scale
from pipeswap.pipeline.weights import StageWeights
from pipeswap.schedule.kinds import SCHEDULES
from pipeswap.schedule.modes import (
    NESTEROV_DELAY_LR_POWER,
    NESTEROV_SGD_DELAY_LR_POWER,
    PREDICTION_DELAY_LR_POWER,
    WEIGHT_MODES,
)
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.schedule.timetable import build_schedule

GPT = pipeline_run("gpt2-micro", (1, 1, 1, 1), batch=8, seq_len=16, steps=4, lr=0.05)


@pytest.mark.parametrize("power", [0.0, 1.0, 2.0, 0.5])
@pytest.mark.parametrize("stages", [2, 4, 8])
def test_the_scale_is_one_over_one_plus_the_walked_delay_to_the_power(
    stages: int, power: float
) -> None:
    async_1f1b = build_schedule("async-1f1b", stages, 3 * stages, 1)
    two_bw = build_schedule("2bw", stages, 3 * stages, 2)
    for k in range(stages):
        # async-1f1b: stage k takes its gradients N - 1 - k updates late; 2bw: 1 everywhere.
        assert delay_lr_scale(async_1f1b, k, power) == (stages - k) ** -power
        assert delay_lr_scale(two_bw, k, power) == 2.0**-power
    assert delay_lr_scale(async_1f1b, stages - 1, power) == 1.0


@pytest.mark.parametrize("name", [n for n, kind in SCHEDULES.items() if not kind.asynchronous])
def test_synchronous_schedules_keep_their_rate(name: str) -> None:
    schedule = build_schedule(name, 4, 4, 4)
    assert all(delay_lr_scale(schedule, k, 3.0) == 1.0 for k in range(4))


def test_on_by_default_for_the_recommended_modes_only() -> None:
    on = {name: mode.delay_lr_power for name, mode in WEIGHT_MODES.items() if mode.recommended}
    assert on == {
        "spectrain": PREDICTION_DELAY_LR_POWER,
        "predict-adam": PREDICTION_DELAY_LR_POWER,
        "nesterov": NESTEROV_DELAY_LR_POWER,
    }
    for name in WEIGHT_MODES:
        config = PipelineConfig(stages=4, schedule="async-1f1b", weights=name)
        assert config.delay_power("adamw") == on.get(name, 0.0)
        sgd = NESTEROV_SGD_DELAY_LR_POWER if name == "nesterov" else on.get(name, 0.0)
        assert config.delay_power("sgd") == sgd
        # What the user gives wins, either way.
        assert replace_fields(config, delay_lr_power=0.0).delay_power("sgd") == 0.0
        assert replace_fields(config, delay_lr_power=1.5).delay_power("sgd") == 1.5
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="delay_lr_power"):
            PipelineConfig(stages=4, schedule="async-1f1b", delay_lr_power=bad)


def test_a_scaled_stage_updates_and_predicts_at_the_scaled_rate() -> None:
    # One weight, SGD with momentum, stage 0 of two on async-1f1b: forwards predicted one
    # update ahead. With lr_scale c every update and every prediction uses c * lr.
    lr, momentum, c = 0.05, 0.9, 0.25
    module = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        module.weight.fill_(0.5)
    distances = {("F", 0): 0, ("F", 1): 1, ("F", 2): 1} | {("B", u): 0 for u in range(3)}
    optim = OptimizerConfig(optimizer="sgd", lr=lr, momentum=momentum)
    weights = StageWeights(
        module,
        "spectrain",
        distances,  # type: ignore[arg-type]
        {u: u for u in range(3)},
        optim,
        lr_scale=c,
    )
    w = weights.params[0]
    step = c * lr  # the rate each update steps at: 0.0125, exact in binary
    assert weights.optimizer is not None
    assert weights.optimizer.param_groups[0]["lr"] == lr  # scaled for each update only
    live, buffer = 0.5, 0.0
    for unit, grad in enumerate((0.25, -0.5, 1.0)):
        weights.before("F", unit)  # type: ignore[arg-type]
        # Before the first update there is no direction: the live weight.
        expected = live if unit == 0 else live - step * buffer
        assert w.item() == expected
        weights.after("F", unit)  # type: ignore[arg-type]
        w.grad = torch.full_like(w, grad)
        weights.update(unit)
        buffer = grad if unit == 0 else momentum * buffer + grad
        live = live - step * buffer
        assert w.item() == live


def test_a_warmed_up_rate_is_scaled_at_every_update() -> None:
    optim = OptimizerConfig(optimizer="sgd", lr=0.05, momentum=0.0, lr_warmup=4)
    module = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        module.weight.fill_(1.0)
    weights = StageWeights(module, "stale", {}, {u: u for u in range(3)}, optim, lr_scale=0.5)
    w, live = weights.params[0], 1.0
    for step in range(3):
        w.grad = torch.ones_like(w)
        weights.update(step)
        assert weights.optimizer is not None
        assert weights.optimizer.param_groups[0]["lr"] == optim.lr_at(step)  # as set
        live -= optim.lr_at(step) * 0.5
        assert w.item() == pytest.approx(live, rel=1e-15)


def test_a_scheduler_of_the_user_s_sets_the_rate_the_rule_scales() -> None:
    """An optimizer function's own scheduler writes its rate into the optimizer after each
    update: the rule scales whatever rate is there at the next one, so a constant
    schedule changes nothing and a halving one halves the scaled step."""
    made: list[torch.optim.lr_scheduler.LRScheduler] = []

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.5)
        made.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
        return optimizer

    module = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        module.weight.fill_(1.0)
    args = ("stale", {}, {u: u for u in range(3)})
    described = OptimizerConfig(optimizer="sgd", lr=0.5, momentum=0.0)  # what Pipeline reads
    weights = StageWeights(
        module,
        *args,
        described,
        optimizer_factory=factory,
        lr_scale=0.25,  # type: ignore[arg-type]
    )
    w, live = weights.params[0], 1.0
    for step in range(3):
        w.grad = torch.ones_like(w)
        weights.update(step)
        made[-1].step()
        live -= 0.5 * 0.5**step * 0.25
        assert w.item() == live


def _losses(config: object) -> list[float]:
    return list(Emulator(config).run().losses)  # type: ignore[arg-type]


def test_the_rule_changes_asynchronous_runs_only() -> None:
    sync = replace_fields(GPT, schedule="1f1b", micro_batches=4)
    assert _losses(replace_fields(sync, delay_lr_power=2.0)) == _losses(sync)
    spectrain = replace_fields(GPT, schedule="async-1f1b", weights="spectrain")
    default, off = _losses(spectrain), _losses(replace_fields(spectrain, delay_lr_power=0.0))
    assert default == _losses(replace_fields(spectrain, delay_lr_power=PREDICTION_DELAY_LR_POWER))
    # The first mini-batch sees untrained weights either way; later ones differ.
    assert default[0] == off[0] and default[1:] != off[1:]
