"""Whether a Hugging Face model fits this machine, counted on the meta device before it is built."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.units import format_bytes

# Beyond this many layers a model is counted from one- and two-layer copies (building a
# million blocks, even on the meta device, takes minutes).
_COUNT_DIRECTLY_UP_TO = 2


def meta_build(cls: Any, config: Any) -> nn.Module:
    """``cls(config)`` on the meta device: no memory allocated."""
    with torch.device("meta"):
        module: nn.Module = cls(config)
    return module


def parameter_count(cls: Any, config: Any) -> int:
    """The parameters ``cls(config)`` would have, from meta builds of at most two layers:
    the count is affine in ``num_hidden_layers`` (the blocks are alike)."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= _COUNT_DIRECTLY_UP_TO:
        return _count(meta_build(cls, config))
    counts = []
    for n in (1, 2):
        small = copy.deepcopy(config)
        small.num_hidden_layers = n
        counts.append(_count(meta_build(cls, small)))
    return counts[0] + (layers - 1) * (counts[1] - counts[0])


def memory_bytes(device: torch.device) -> int | None:
    """The memory of ``device``: the GPU's, or this machine's RAM; None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows)
        return None


def check_fits(name: str, count: int, element_bytes: int, device: torch.device) -> None:
    """Refuse, before building anything, a model whose weights alone exceed ``device``'s memory."""
    available = memory_bytes(device)
    needed = count * element_bytes
    if available is None or needed <= available:
        return
    where = "this GPU's" if device.type == "cuda" else "this machine's"
    raise PipeswapError(
        f"{name} has {count:,} parameters: {format_bytes(needed)} of weights alone, more than "
        f"{where} {format_bytes(available)} of memory, so it cannot be built here; estimate "
        "its profile instead (built on the meta device, nothing is allocated), or shrink its "
        "config"
    )


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
