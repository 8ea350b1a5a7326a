"""Which optimizer state a loop's budget counts: the optimizers offload is given, and the
state the CPU's storage count cannot see (optimizers it was not given, or that have made
none yet)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.profiling.step import optimizer_state_bytes

__all__ = ["given_optimizers", "optimizer_name", "trainable_bytes", "unseen_state_bytes"]


def given_optimizers(model: nn.Module, optimizer: Any) -> tuple[str, list[torch.optim.Optimizer]]:
    """offload's ``optimizer``: a name, the optimizer, or the optimizers the loop steps (a
    list: a body's and a head's); (the name whose state is the largest, the optimizers).
    A trainable parameter no given optimizer holds is warned of once (its state is counted
    as AdamW's: the storage count cannot see an optimizer it was not given)."""
    if isinstance(optimizer, str):
        optimizer_state_bytes(optimizer, 0)  # an unknown name: refused now, not at a step
        return optimizer, []
    given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    if not (
        isinstance(given, list | tuple)
        and given
        and all(isinstance(o, torch.optim.Optimizer) for o in given)
    ):
        what = "an empty list" if isinstance(given, list | tuple) and not given else None
        raise ConfigError(
            f"{{optimizer}} is {what or 'a ' + type(optimizer).__name__}: pass the optimizer your loop "
            "steps, a list of them (optimizer=[body_optimizer, head_optimizer]), or a name "
            "(adamw, adam, sgd)"
        )
    held = {id(p) for o in given for group in o.param_groups for p in group["params"]}
    free = [p for p in model.parameters() if p.requires_grad and id(p) not in held]
    if free:
        warnings.warn(
            f"pipeswap.offload: {len(free)} trainable parameters of the model are in no "
            "optimizer given to offload; their state is counted as AdamW's: pass every "
            "optimizer your loop steps (optimizer=[first, second])",
            RuntimeWarning,
            stacklevel=3,
        )
    names = [optimizer_name(o) for o in given]
    return max(names, key=lambda name: optimizer_state_bytes(name, 1)), list(given)


def unseen_state_bytes(
    model: nn.Module, optimizer: str, given: Sequence[torch.optim.Optimizer]
) -> int:
    """Optimizer state the storage count cannot see: all of it when the optimizer was
    named (not ``given``); of each given optimizer that has made none yet (no step has
    run), its parameters' (by its own kind; none for plain SGD, which makes none); of
    trainable parameters in no given optimizer, AdamW's."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not given:
        return optimizer_state_bytes(optimizer, _nbytes(trainable))
    held = {id(p) for o in given for group in o.param_groups for p in group["params"]}
    unseen = optimizer_state_bytes("adamw", _nbytes(p for p in trainable if id(p) not in held))
    for o in given:
        if not o.state:
            params = (
                p
                for group in o.param_groups
                if not _keeps_no_state(o, group)
                for p in group["params"]
                if p.requires_grad
            )
            unseen += optimizer_state_bytes(optimizer_name(o), _nbytes(params))
    return unseen


def _keeps_no_state(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``optimizer`` never makes state for ``group``: plain SGD (no momentum) keeps
    no buffer, so its state stays empty after every step (counted as momentum SGD's, each
    plan held a buffer per parameter more than the device ever did)."""
    return isinstance(optimizer, torch.optim.SGD) and not group.get("momentum")


def trainable_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s trainable parameters (one gradient of each)."""
    return _nbytes(p for p in model.parameters() if p.requires_grad)


def _nbytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's name as the state model knows it (adam, adamw or sgd)."""
    name = type(optimizer).__name__.lower()
    return name if name in ("adam", "adamw", "sgd") else "adamw"
