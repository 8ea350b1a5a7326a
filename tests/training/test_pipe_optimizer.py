"""pipeswap/training/pipe_optimizer.py: what a Pipeline's stages train with."""

from __future__ import annotations

import warnings

import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.optim import OptimizerConfig
from pipeswap.training.pipe_optimizer import pipe_optimizer


def test_a_config_or_nothing_is_pipeswap_s_own_update() -> None:
    assert pipe_optimizer(None, None) == (None, OptimizerConfig())
    given = OptimizerConfig(optimizer="sgd", lr=0.5)
    assert pipe_optimizer(given, 0.25) == (
        None,
        OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad_norm=0.25),
    )


def test_the_user_s_optimizer_is_kept_and_described() -> None:
    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=0.003, weight_decay=0.1)

    kept, described = pipe_optimizer(factory, None)
    assert kept is factory
    assert (described.optimizer, described.lr, described.weight_decay) == ("adamw", 0.003, 0.1)
    # One pipeswap does not build is described as SGD's: its own rate, kept constant.
    _, other = pipe_optimizer(lambda ps: torch.optim.RMSprop(ps, lr=0.01), None)
    assert other.optimizer == "sgd"


def test_accumulation_is_refused_saying_what_to_do() -> None:
    with pytest.raises(ConfigError, match="hand pipe.step the 2 batches at once"):
        pipe_optimizer(OptimizerConfig(accumulate=2), None)


def test_an_optimizer_object_is_refused_saying_to_pass_a_function() -> None:
    """Each stage builds its own optimizer over its own parameters: an optimizer built
    over the whole model cannot be split, and a bare 'not callable' would not say why."""
    built = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ConfigError, match="optimizer=lambda params: torch.optim.AdamW"):
        pipe_optimizer(built, None)  # type: ignore[arg-type]


def test_a_warm_up_the_function_builds_is_read_at_its_rate() -> None:
    """A scheduler built with the optimizer (a warm-up from 0) has set ``lr`` already:
    the rate it was built with is the one described, and the throwaway optimizer has
    stepped, so the script's stepping of its scheduler finds torch's order kept."""
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []

    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(params, lr=0.01)
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: t / 4))
        return optimizer

    _, described = pipe_optimizer(factory, None)
    assert described.lr == 0.01 and schedulers[0].optimizer.param_groups[0]["lr"] == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedulers[0].step()
