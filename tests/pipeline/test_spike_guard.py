"""The spike guard: a stage's gradient norm far above its recent ones is clipped to a bound.

Covers: pipeswap/pipeline/spike_guard.py (SpikeGuard), pipeswap/pipeline/weights.py
(StageWeights.guard_spikes, its checkpoint state) and pipeswap/schedule/pipeline_config.py
(PipelineConfig.stability_rule). The runtime == emulator equality with the rule on is in
test_runtime.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.spike_guard import SPIKE_ALPHA, SPIKE_WARMUP, SPIKE_Z, SpikeGuard
from pipeswap.pipeline.weights import StageWeights
from pipeswap.schedule.modes import WEIGHT_MODES
from pipeswap.schedule.pipeline_config import PipelineConfig


def _moments(norms: list[float]) -> tuple[float, float]:
    """The guard's moving mean and variance after ``norms``, written out (no clip in them)."""
    mean, variance = norms[0], 0.0
    for norm in norms[1:]:
        delta = norm - mean
        mean += (1 - SPIKE_ALPHA) * delta
        variance = SPIKE_ALPHA * (variance + (1 - SPIKE_ALPHA) * delta * delta)
    return mean, variance


def test_after_the_warm_up_a_spike_is_clipped_to_mean_plus_z_std() -> None:
    guard = SpikeGuard()
    steady = [1.0, 1.2, 0.9, 1.1, 1.0, 0.95]
    # The warm-up and the ordinary norms pass unchanged.
    assert [guard.factor(n) for n in steady] == [1.0] * len(steady)
    mean, variance = _moments(steady)
    assert (guard.mean, guard.variance) == (mean, variance)
    bound = mean + SPIKE_Z * math.sqrt(variance)
    assert guard.factor(50.0) == bound / 50.0
    assert guard.clipped == 1
    # The statistics take the clipped norm, not the spike.
    assert guard.mean == _moments([*steady, bound])[0]
    # A norm within the bound passes.
    assert guard.factor(guard.mean) == 1.0


def test_the_warm_up_never_clips_and_a_norm_that_is_not_finite_is_left_alone() -> None:
    guard = SpikeGuard()
    assert [guard.factor(n) for n in [1.0, 1e6, 1.0, 1e9, 1.0]] == [1.0] * SPIKE_WARMUP
    seen = guard.seen
    assert guard.factor(math.inf) == 1.0 and guard.factor(math.nan) == 1.0
    assert guard.seen == seen  # the statistics do not take them


def test_its_state_round_trips() -> None:
    guard = SpikeGuard()
    for norm in [1.0, 2.0, 1.5, 1.0, 1.2, 1.1, 30.0]:
        guard.factor(norm)
    other = SpikeGuard()
    other.load_state(guard.state())
    assert other == guard
    assert other.factor(40.0) == guard.factor(40.0)


def _weights(guard: bool) -> StageWeights:
    module = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        module.weight.zero_()
    optim = OptimizerConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    return StageWeights(module, "stale", {}, {u: u for u in range(8)}, optim, guard_spikes=guard)


def _steps(weights: StageWeights, grads: list[torch.Tensor]) -> list[float]:
    """The length of each update's step (SGD at lr 1: the applied gradient's norm)."""
    lengths = []
    for step, grad in enumerate(grads):
        before = weights.params[0].detach().clone()
        weights.params[0].grad = grad.clone()
        weights.update(step)
        lengths.append(float((before - weights.params[0].detach()).norm()))
    return lengths


def test_a_guarded_stage_applies_a_spike_at_the_bound_and_an_unguarded_one_in_full() -> None:
    unit = torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    norms = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 100.0]
    grads = [unit * n for n in norms]
    guarded = _weights(True)
    assert _steps(_weights(False), grads) == pytest.approx(norms, rel=1e-12)
    lengths = _steps(guarded, grads)
    assert lengths[:-1] == pytest.approx(norms[:-1], rel=1e-12)
    mean, variance = _moments([float(g.norm()) for g in grads[:-1]])
    assert lengths[-1] == pytest.approx(mean + SPIKE_Z * math.sqrt(variance), rel=1e-12)
    assert guarded.spike_guard is not None and guarded.spike_guard.clipped == 1
    # The guard's statistics travel with the stage's checkpoint.
    restored = _weights(True)
    restored.load_state(guarded.state())
    assert restored.spike_guard == guarded.spike_guard


def test_the_rule_is_on_where_the_delay_scaled_rate_is() -> None:
    for name, mode in WEIGHT_MODES.items():
        config = PipelineConfig(stages=4, schedule="async-1f1b", weights=name)
        assert config.stability_rule == mode.recommended
        off = PipelineConfig(stages=4, schedule="async-1f1b", weights=name, delay_lr_power=0.0)
        on = PipelineConfig(stages=4, schedule="async-1f1b", weights=name, delay_lr_power=1.0)
        assert not off.stability_rule and on.stability_rule
    # A synchronous schedule takes no delayed gradient: nothing to guard.
    assert not PipelineConfig(stages=4, schedule="1f1b", delay_lr_power=2.0).stability_rule
