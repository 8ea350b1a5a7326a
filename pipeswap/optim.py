"""The optimizers pipeswap trains with, their default learning rates, and how they are built."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pipeswap.errors import PipeswapError

OPTIMIZERS = ("sgd", "adam", "adamw")
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def check_optimizer(name: str) -> None:
    if name not in OPTIMIZERS:
        raise PipeswapError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")


def make_optimizer(
    name: str,
    params: Iterable[nn.Parameter],
    *,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam or AdamW with the single-tensor (foreach=False) kernels.

    Every mode builds its optimizer here, so a data-parallel run and a pipeline stage
    apply the same arithmetic to the same parameter.
    """
    check_optimizer(name)
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=False
        )
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=False)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
