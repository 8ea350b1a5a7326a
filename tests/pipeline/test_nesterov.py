"""``--weights nesterov`` (Ajanthan et al., arXiv 2505.01099, as released; its SGD form).

Covers: pipeswap/pipeline/weights.py (the nesterov mode), pipeswap/optim.py (make_nadam),
pipeswap/schedule/pipeline_config.py (what is refused).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from runtime_check import assert_runtime_matches_emulator
from support import pipeline_run
from torch import nn

from pipeswap.checkpoint import CheckpointPlan
from pipeswap.config_fields import replace_fields
from pipeswap.errors import PipeswapError
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.weights import StageWeights
from pipeswap.schedule.modes import WEIGHT_MODES
from pipeswap.train_config import TrainConfig

PSI = 0.004  # NAdam's momentum decay


def _nadam_by_hand(
    theta: float, grads: list[float], lr: float, beta1: float, wd: float, decoupled: bool
) -> list[float]:
    """NAdam(W) in float64 from its formulas (torch.optim.NAdam docs, Dozat 2016)."""
    beta2, eps = 0.999, 1e-8
    m = v = 0.0
    mu_product = 1.0
    out = []
    for t, g in enumerate(grads, start=1):
        if decoupled:
            theta *= 1 - lr * wd
        else:
            g = g + wd * theta
        mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * PSI))
        mu_next = beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * PSI))
        mu_product *= mu_t
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = mu_next * m / (1 - mu_product * mu_next) + (1 - mu_t) * g / (1 - mu_product)
        theta = theta - lr * m_hat / (math.sqrt(v / (1 - beta2**t)) + eps)
        out.append(theta)
    return out


def _one_weight(mode: str, distances: dict[tuple[str, int], int], **kw: object) -> StageWeights:
    module = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        module.weight.fill_(0.5)
    units = {u for _, u in distances}
    return StageWeights(module, mode, distances, {u: u for u in units}, **kw)  # type: ignore[arg-type]


GRADS = [0.3, -1.2, 0.7, 0.05, 2.0]


def _undelayed(config: OptimizerConfig) -> list[float]:
    """The weight after each update of a nesterov stage with no delay, fed GRADS."""
    distances = {(k, u): 0 for u in range(len(GRADS)) for k in ("F", "B")}
    weights = _one_weight("nesterov", distances, optimizer_config=config)
    seen = []
    for t, g in enumerate(GRADS):
        weights.before("F", t)
        weights.after("F", t)
        weights.before("B", t)
        weights.params[0].grad = torch.full((1, 1), g, dtype=torch.float64)
        weights.after("B", t)
        weights.update(t)
        seen.append(weights.params[0].item())
    return seen


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_without_delay_nesterov_is_plain_nadam(optimizer: str) -> None:
    lr, beta1, wd = 0.01, 0.99, 0.1
    config = OptimizerConfig(optimizer=optimizer, lr=lr, momentum=beta1, weight_decay=wd)
    expected = _nadam_by_hand(0.5, GRADS, lr, beta1, wd, decoupled=optimizer == "adamw")
    # torch keeps the step count (hence mu_t) in float32: agreement to ~1e-10, while a
    # wrong index or bias correction in the formula would differ by ~1e-3.
    assert _undelayed(config) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_with_delay_the_backward_sees_its_forwards_version_and_the_update_the_live_one() -> None:
    # Stage with forward distance 2: units 0, 1, 2 run F before the update of unit 0.
    distances = {("F", u): 2 for u in range(3)} | {("B", u): 0 for u in range(3)}
    config = OptimizerConfig(optimizer="adamw", lr=0.1, momentum=0.9)
    weights = _one_weight("nesterov", distances, optimizer_config=config)
    w = weights.params[0]
    seen = []
    weights.before("F", 0)
    seen.append(w.item())  # version 0
    weights.after("F", 0)
    weights.before("B", 0)
    assert w.item() == seen[0]
    w.grad = torch.ones_like(w)
    weights.after("B", 0)
    weights.update(0)
    live = w.item()
    assert live != seen[0]
    weights.before("F", 1)  # forward on the live weights (version 1) ...
    assert w.item() == live
    weights.after("F", 1)
    w.grad = torch.ones_like(w)
    weights.update(1)  # ... updated once more before its backward,
    newest = w.item()
    weights.before("B", 1)  # ... whose backward runs on version 1, not 2,
    assert w.item() == live
    weights.after("B", 1)
    assert w.item() == newest  # ... and the live weights come back.


def _config(**kw: object) -> TrainConfig:
    base = pipeline_run(
        "gpt2-micro",
        (1, 1, 1, 1),
        schedule="async-1f1b",
        weights="nesterov",
        optimizer="adamw",
        batch=4,
        seq_len=16,
        steps=9,
        lr=3e-3,
        momentum=0.99,
    )
    return replace_fields(base, **kw)  # type: ignore[arg-type]


def test_without_delay_nesterov_with_sgd_is_sgd_with_nesterov_momentum() -> None:
    config = OptimizerConfig(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    ends = {}
    for nesterov in (True, False):  # and not heavy-ball momentum, which ends elsewhere
        reference = nn.Parameter(torch.full((1, 1), 0.5, dtype=torch.float64))
        sgd = torch.optim.SGD(
            [reference], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov
        )
        ends[nesterov] = []
        for g in GRADS:
            reference.grad = torch.full((1, 1), g, dtype=torch.float64)
            sgd.step()
            ends[nesterov].append(reference.item())
    assert _undelayed(config) == ends[True]
    assert abs(ends[True][-1] - ends[False][-1]) > 1e-3


def test_config_refuses_an_optimizer_without_momentum() -> None:
    assert "nesterov" in WEIGHT_MODES
    _config()
    _config(optimizer="sgd", momentum=0.9)  # SGD with Nesterov momentum
    with pytest.raises(PipeswapError, match="Nesterov momentum.*sgd momentum 0.0 has none"):
        _config(optimizer="sgd", momentum=0.0)
    with pytest.raises(PipeswapError, match="beta1"):
        _config(momentum=1.0)


def test_nesterov_resumes_bit_identically(tmp_path: Path) -> None:
    config = _config()
    alone = Emulator(config).run()
    plan = CheckpointPlan(str(tmp_path), 4, {"t": 1}, config.require_pipeline().num_stages)
    checkpointed = Emulator(config, checkpoint=plan).run()
    assert (checkpointed.losses, checkpointed.params_sha256) == (alone.losses, alone.params_sha256)
    resumed = Emulator(config, resume=(str(tmp_path), 4)).run()
    assert resumed.losses == alone.losses and resumed.params_sha256 == alone.params_sha256
    # Not vacuous: the mode trains differently from stash with Adam(W).
    stash = Emulator(replace_fields(config, weights="stash")).run()
    assert stash.params_sha256 != alone.params_sha256


def test_nesterov_trains_gpt2_micro_at_four_stages() -> None:
    config = _config(batch=8, seq_len=32, steps=60)
    losses = Emulator(config).run().losses
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


@pytest.mark.dist
@pytest.mark.parametrize("balance", [(2, 2), pytest.param((1, 1, 1, 1), marks=pytest.mark.slow)])
def test_runtime_bitwise_equal_to_emulator(balance: tuple[int, ...]) -> None:
    configs = [_config(balance=balance, steps=5, optimizer=o) for o in ("adamw", "adam", "sgd")]
    assert_runtime_matches_emulator(configs, len(balance))
