"""What a Pipeline's stages train with: an OptimizerConfig, or the user's own optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from pipeswap.config_fields import require
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.predict import DIRECTED

__all__ = ["OptimizerFactory", "describe_optimizer", "pipe_optimizer"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def pipe_optimizer(
    optimizer: OptimizerConfig | OptimizerFactory | None, clip_grad_norm: float | None
) -> tuple[OptimizerFactory | None, OptimizerConfig]:
    """(the user's factory or None, the settings pipeswap knows of the update): the
    default OptimizerConfig when none is given."""
    factory: OptimizerFactory | None = None
    if optimizer is None or isinstance(optimizer, OptimizerConfig):
        optim = optimizer or OptimizerConfig()
    else:
        require(
            callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer),
            f"optimizer= takes a function from a stage's parameters to its optimizer (each "
            f"stage builds its own), not {type(optimizer).__name__!r}: write "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=...)",
        )
        # Its settings, as far as pipeswap knows them, are checked as a config's are.
        probe = optimizer([nn.Parameter(torch.zeros(1))])
        if isinstance(probe, DIRECTED):
            # No gradient: nothing moves, but a scheduler the function built (and the
            # script steps) sees an optimizer that stepped, as torch expects.
            probe.step()
        # One pipeswap does not build keeps its own rate: a named optimizer's is constant.
        factory, optim = optimizer, describe_optimizer(probe) or OptimizerConfig(optimizer="sgd")
    if clip_grad_norm is not None:
        optim = replace(optim, clip_grad_norm=clip_grad_norm)
    require(
        optim.accumulate == 1,
        f"accumulate is {optim.accumulate}: hand pipe.step the {optim.accumulate} "
        "batches at once with that many times the micro_batches (the same updates)",
    )
    return factory, optim


def describe_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerConfig | None:
    """The OptimizerConfig that builds the same update as ``optimizer`` (its first group's
    settings), or None for one pipeswap does not build (SGD, Adam and AdamW it does). The
    rate is the one it was built with: a scheduler built with it (a warm-up) may have set
    ``lr`` to another, which torch keeps the first as ``initial_lr``."""
    if not isinstance(optimizer, DIRECTED):
        return None
    group = optimizer.param_groups[0]
    return OptimizerConfig(
        optimizer=type(optimizer).__name__.lower(),
        lr=float(group.get("initial_lr", group["lr"])),
        momentum=float(group.get("momentum", OptimizerConfig.momentum)),
        weight_decay=float(group["weight_decay"]),
    )
