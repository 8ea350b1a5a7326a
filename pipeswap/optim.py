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


# NAdam's momentum-decay schedule psi (torch.optim.NAdam's default, which the Nesterov
# method for asynchronous pipelines runs with: PluralisResearch/AsyncPP, optim/nadamw.py).
NADAM_MOMENTUM_DECAY = 0.004


def make_nadam(
    params: Iterable[nn.Parameter],
    *,
    lr: float,
    beta1: float,
    weight_decay: float = 0.0,
    decoupled: bool = True,
) -> torch.optim.Optimizer:
    """NAdam (Nesterov-accelerated Adam) with the single-tensor (foreach=False) kernel.

    ``beta1`` is the momentum coefficient (the Nesterov method for asynchronous pipelines
    uses 0.99); ``decoupled`` selects AdamW-style weight decay (NAdamW) instead of L2.
    Per parameter and step t (torch.optim.NAdam, Dozat 2016), with g_t the gradient
    (+ weight_decay * theta when not decoupled; decoupled: theta *= 1 - lr * weight_decay):

        mu_t     = beta1 * (1 - 0.5 * 0.96 ** (t * psi))
        m_t      = beta1 * m_{t-1} + (1 - beta1) * g_t
        v_t      = beta2 * v_{t-1} + (1 - beta2) * g_t ** 2
        m_hat    = mu_{t+1} * m_t / (1 - prod_{i<=t+1} mu_i) + (1 - mu_t) * g_t / (1 - prod_{i<=t} mu_i)
        theta_t  = theta_{t-1} - lr * m_hat / (sqrt(v_t / (1 - beta2 ** t)) + eps)
    """
    return torch.optim.NAdam(
        params,
        lr=lr,
        betas=(beta1, 0.999),
        weight_decay=weight_decay,
        momentum_decay=NADAM_MOMENTUM_DECAY,
        decoupled_weight_decay=decoupled,
        foreach=False,
    )


def optimizer_for_mode(
    weights: str,
    name: str,
    params: Iterable[nn.Parameter],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> torch.optim.Optimizer:
    """The optimizer a pipeline weight mode updates with: NAdam for ``nesterov`` (with
    ``momentum`` as beta1, AdamW-style decay unless ``name`` is adam), else ``name``'s."""
    if weights == "nesterov":
        return make_nadam(
            params, lr=lr, beta1=momentum, weight_decay=weight_decay, decoupled=name != "adam"
        )
    return make_optimizer(name, params, lr=lr, momentum=momentum, weight_decay=weight_decay)
