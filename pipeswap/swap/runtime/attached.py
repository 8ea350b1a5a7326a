"""What a plan attaches to a user's modules, made so that a copy of the model carries none of it.

A user copies a model with a plan attached (``copy.deepcopy`` for an EMA or teacher model,
``torch.save(model)``): the copy is their model without pipeswap. Its copies of the hooks do
nothing, and its recomputed layers get their own forward back, not a wrapper bound to the
original's layers (which ran the original's weights for the copy).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["AttachedHook", "own_forward"]


def _nothing(*args: Any, **kwargs: Any) -> None:
    """A copied hook: the copy has no plan."""


def _inert() -> Callable[..., None]:
    return _nothing


class AttachedHook:
    """A module hook of a plan; its copies (deepcopy, pickling) do nothing."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _nothing

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


def own_forward(module: nn.Module) -> Callable[..., Any]:
    """``module``'s class forward, bound to it: what a copy of a wrapped layer gets."""
    return types.MethodType(type(module).forward, module)
