"""pipeswap/optim.py: OptimizerConfig's defaults and checks, the rate schedule, construction."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.optim import DEFAULT_LR, OptimizerConfig


def test_the_default_rate_is_the_optimizers() -> None:
    for name, rate in DEFAULT_LR.items():
        assert OptimizerConfig(optimizer=name).base_lr == rate
    assert OptimizerConfig(optimizer="adam", lr=0.2).base_lr == 0.2


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"optimizer": "lion"}, "optimizer 'lion' is not an optimizer"),
        ({"lr": 0.0}, "lr is 0.0"),
        ({"lr": float("inf")}, "lr is inf"),
        ({"momentum": 1.0}, "momentum is 1.0; use a number in \\[0, 1\\)"),
        ({"weight_decay": -1.0}, "weight_decay is -1.0"),
        ({"lr_warmup": -1}, "lr_warmup must be 0"),
        ({"lr_schedule": "step"}, "use one of constant, linear, cosine"),
        ({"lr_warmup": 4, "lr_decay_steps": 4}, "use more steps than lr_warmup"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**fields)  # type: ignore[arg-type]


def test_warm_up_ramps_linearly_then_holds() -> None:
    config = OptimizerConfig(optimizer="sgd", lr=0.3, lr_warmup=3)
    assert [config.lr_at(t) for t in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3])
    assert OptimizerConfig(optimizer="sgd", lr=0.3).lr_at(0) == 0.3


def test_linear_and_cosine_decay_after_the_warm_up_in_closed_form() -> None:
    linear = OptimizerConfig(
        optimizer="sgd", lr=0.4, lr_warmup=2, lr_schedule="linear", lr_decay_steps=6
    )
    # Warm-up 0.2, 0.4; from the first full-rate update (t = 1) down over 5 updates to 0.
    assert [linear.lr_at(t) for t in range(8)] == pytest.approx(
        [0.2, 0.4, 0.32, 0.24, 0.16, 0.08, 0.0, 0.0]
    )
    cosine = OptimizerConfig(optimizer="sgd", lr=1.0, lr_schedule="cosine", lr_decay_steps=4)
    expected = [0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(4)]
    assert [cosine.lr_at(t) for t in range(4)] == pytest.approx(expected)
    assert cosine.lr_varies and not OptimizerConfig(optimizer="sgd").lr_varies


def test_a_run_decays_over_its_own_steps_unless_told_otherwise() -> None:
    from pipeswap.train_config import TrainConfig

    optim = OptimizerConfig(optimizer="sgd", lr_schedule="cosine")
    run = TrainConfig("gpt2-micro", seq_len=16, steps=7, optim=optim).resolved()
    assert run.optim.lr_decay_steps == 7
    fixed = replace(optim, lr_decay_steps=20)
    assert TrainConfig("gpt2-micro", seq_len=16, steps=7, optim=fixed).resolved().optim == fixed
    with pytest.raises(ConfigError, match="train more steps, or give lr_decay_steps"):
        TrainConfig("gpt2-micro", steps=2, optim=replace(optim, lr_warmup=2)).resolved()


def test_build_makes_the_named_optimizer_with_single_tensor_kernels() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = OptimizerConfig(optimizer="sgd", momentum=0.5).build(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.5
    assert sgd.defaults["foreach"] is False and sgd.defaults["lr"] == DEFAULT_LR["sgd"]
    assert isinstance(OptimizerConfig(optimizer="adamw").build(params), torch.optim.AdamW)
    nadam = OptimizerConfig(optimizer="adamw", momentum=0.99).build(params, nesterov=True)
    assert isinstance(nadam, torch.optim.NAdam)
    assert nadam.defaults["betas"][0] == 0.99 and nadam.defaults["decoupled_weight_decay"]


def test_a_loss_that_is_no_longer_finite_stops_the_run_naming_the_fix() -> None:
    config = OptimizerConfig(optimizer="sgd", lr=1e5, lr_warmup=4)
    config.check_loss(5.4, 0)  # a finite loss passes
    for loss in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ConfigError, match="training diverged") as info:
            config.check_loss(loss, 1)
        # the learning rate of that mini-batch (warm-up counted) and the settings to change
        assert "at learning rate 50000;" in str(info.value)
        assert info.value.message.endswith(
            "lower {lr}, or ramp it up with {lr_warmup}; {keep_nonfinite} trains on regardless"
        )
    OptimizerConfig(optimizer="sgd", keep_nonfinite=True).check_loss(
        float("nan"), 1
    )  # asked to go on


def test_the_first_non_finite_parameter_or_input_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    config = OptimizerConfig(optimizer="sgd")
    with pytest.raises(
        ConfigError,
        match=r"\(parameter '1.bias' is not finite\): the model or its data held non-finite values before any update",
    ):
        config.check_loss(float("nan"), 0, model=model)
    with pytest.raises(ConfigError, match=r"mini-batch 0 \(the input is not finite\)"):
        config.check_loss(float("nan"), 0, inputs=(torch.tensor([float("nan")]),))
    with pytest.raises(
        ConfigError, match=r"mini-batch 3 \(parameter '1.bias' is not finite\): training diverged"
    ):
        config.check_loss(float("nan"), 3, model=model)


def test_clip_grad_norm_must_be_positive() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="clip_grad_norm"):
            OptimizerConfig(clip_grad_norm=bad)


def test_a_run_of_unknown_length_keeps_the_task_s_rate_constant() -> None:
    """steps None (pipeswap.Pipeline without steps=): the task's optimizer and rate, no
    warm-up or decay, which are fractions of the run; a decay given needs its length."""
    filled = OptimizerConfig().filled("lm", None)
    assert (filled.name, filled.base_lr, filled.warmup, filled.schedule) == (
        "adamw",
        3e-3,
        0,
        "constant",
    )
    assert filled.lr_at(0) == filled.lr_at(10**6) == 3e-3
    given = OptimizerConfig(lr_warmup=5).filled("lm", None)
    assert given.warmup == 5 and given.lr_at(0) == pytest.approx(3e-3 / 5)
    with pytest.raises(ConfigError, match="give .*lr_decay_steps"):
        OptimizerConfig(lr_schedule="cosine").filled("lm", None)
    decaying = OptimizerConfig(lr_schedule="cosine", lr_decay_steps=100).filled("lm", None)
    assert decaying.lr_at(100) == 0.0
