"""The rates a tied parameter's copy steps at: its optimizer's, moved as its stage's own are.

An optimizer function (pipeswap.Pipeline's ``optimizer=``) builds each stage's optimizer,
and one more for each copy of a parameter tied across stages (pipeswap.pipeline.weights);
a scheduler the script builds with it and keeps is the last one built, the stage's own.
The plain loop's one scheduler moves every rate at once: so each copy's rates are the ones
its optimizer was built with, times the factor the stage's own first rate moved by since
it was built (a warm-up's, a decay's, one set by hand). A stage with no parameters of its
own steps its copies at their optimizers' rates as they are.
"""

from __future__ import annotations

import torch

__all__ = ["built_rates", "followed_rates"]


def built_rates(optimizer: torch.optim.Optimizer | None) -> list[float]:
    """Each group's rate as ``optimizer`` was built (a scheduler built with it keeps that
    as ``initial_lr`` and may have moved ``lr`` already)."""
    if optimizer is None:
        return []
    return [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]


def followed_rates(
    copy: torch.optim.Optimizer,
    copy_built: list[float],
    own: torch.optim.Optimizer | None,
    own_built: list[float],
) -> list[float]:
    """The rates ``copy`` steps at now (``*_built``: :func:`built_rates` of each)."""
    if own is None or not own_built or own_built[0] == 0:
        return [g["lr"] for g in copy.param_groups]
    factor = own.param_groups[0]["lr"] / own_built[0]
    return [rate * factor for rate in copy_built]
