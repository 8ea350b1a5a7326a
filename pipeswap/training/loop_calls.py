"""What a user's forward call looks like to offload: its signature, the cache it asks for."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from pipeswap.errors import PipeswapError

# What a forward call looks like to a plan: every tensor's shape, dtype and device, every
# other argument's value, and the autocast dtype it runs under.
Signature = tuple[Any, ...]


def signature(args: Any, kwargs: Any, device: torch.device) -> Signature:
    leaves, spec = tree_flatten((args, kwargs))
    shape = tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad)
        if isinstance(x, torch.Tensor)
        else repr(x)
        for x in leaves
    )
    cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return (str(spec), shape, cast)


def takes_use_cache(forward: Any) -> bool:
    """Whether a forward takes ``use_cache`` (a Hugging Face model, which builds a key/value
    cache in training forwards unless told not to)."""
    try:
        return "use_cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or C function: it names no parameters
        return False


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's keyword arguments with ``use_cache=False`` where the call does not say (as
    transformers' own gradient checkpointing does); a training call that asks for the cache
    is refused: the cache would keep the keys and values that a plan moves off the device
    or recomputes."""
    asked = kwargs.get("use_cache")
    if asked is None:
        return {**kwargs, "use_cache": False}
    if asked:
        raise PipeswapError(
            "use_cache=True in a training forward under offload: the cache keeps every "
            "layer's keys and values on the device beyond their backward, so neither "
            "swapping nor recomputing could free them; pass use_cache=False (or leave it "
            "out: offload then passes use_cache=False, as gradient checkpointing does)"
        )
    return kwargs


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's name as the state model knows it (adam, adamw or sgd)."""
    name = type(optimizer).__name__.lower()
    return name if name in ("adam", "adamw", "sgd") else "adamw"
