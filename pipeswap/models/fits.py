"""Whether a Hugging Face model fits this machine, counted on the meta device before it is built."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.units import format_bytes

__all__ = [
    "MAX_BLOCKS",
    "check_depth",
    "check_fits",
    "depths",
    "memory_bytes",
    "meta_build",
    "parameter_count",
]

# Beyond this many layers a model is counted from one- and two-layer copies (building a
# million blocks, even on the meta device, takes minutes).
_COUNT_DIRECTLY_UP_TO = 2
# Deeper models are refused before they are built: a block takes about a millisecond to
# build even on the meta device (a million: over 15 minutes), and then to profile and to
# plan; the deepest published models have a few hundred.
MAX_BLOCKS = 4096
# The block counts of a config: layer counts (the name transformers maps them to) and the
# per-stage ``depths`` of convolutional families.
_LAYER_FIELDS = ("num_hidden_layers", "decoder_layers", "num_decoder_layers")


def meta_build(cls: Any, config: Any) -> nn.Module:
    """``cls(config)`` on the meta device: no memory allocated."""
    with torch.device("meta"):
        module: nn.Module = cls(config)
    return module


def _whole(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def depths(config: Any) -> dict[tuple[str, int | None], int]:
    """Every block count of ``config``, keyed by (attribute, index in its list or None):
    ``n_layer`` of GPT-2, ``decoder_layers``, each stage of ``depths`` (ResNet)."""
    found: dict[tuple[str, int | None], int] = {}
    aliases = getattr(config, "attribute_map", {})
    for name in _LAYER_FIELDS:
        value = getattr(config, name, None)
        if _whole(value):
            found[(aliases.get(name, name), None)] = value
    stages = getattr(config, "depths", None)
    if isinstance(stages, list | tuple) and all(_whole(d) for d in stages):
        found.update({("depths", i): d for i, d in enumerate(stages)})
    return found


def _with_depths(config: Any, chosen: dict[tuple[str, int | None], int]) -> Any:
    small = copy.deepcopy(config)
    for (name, index), value in chosen.items():
        if index is None:
            setattr(small, name, value)
        else:
            stages = list(getattr(small, name))
            stages[index] = value
            setattr(small, name, stages)
    return small


def parameter_count(cls: Any, config: Any) -> int:
    """The parameters ``cls(config)`` would have, from meta builds of at most two blocks
    per block count (:func:`depths`): the count is affine in each (the blocks are alike)."""
    found = depths(config)
    if all(d <= _COUNT_DIRECTLY_UP_TO for d in found.values()):
        return _count(meta_build(cls, config))
    base = {key: min(d, 1) for key, d in found.items()}
    least = _count(meta_build(cls, _with_depths(config, base)))
    total = least
    for key, d in found.items():
        if d >= 2:
            grown = _count(meta_build(cls, _with_depths(config, {**base, key: 2})))
            total += (d - 1) * (grown - least)
    return total


def check_depth(name: str, config: Any, count: int, element_bytes: int) -> None:
    """Refuse, before building anything (the meta device included), a model of more than
    MAX_BLOCKS blocks, naming its size (``count`` parameters) and the limit."""
    found = depths(config)
    blocks = sum(found.values())
    if blocks <= MAX_BLOCKS:
        return
    deepest = max(found, key=lambda key: found[key])
    field = deepest[0] if deepest[1] is None else f"{deepest[0]}[{deepest[1]}]"
    raise PipeswapError(
        f"{name} has {blocks:,} blocks ({field} {found[deepest]:,}): {count:,} parameters, "
        f"{format_bytes(count * element_bytes)} of weights at {element_bytes} bytes each; "
        f"pipeswap builds models of at "
        f"most {MAX_BLOCKS:,} blocks (each takes about a millisecond to build, even on the "
        f"meta device, and then to profile and plan): lower {field} in its config.json"
    )


def memory_bytes(device: torch.device) -> int | None:
    """The memory of ``device``: the GPU's, or this machine's RAM (less when this process's
    memory cgroup allows less); None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows)
        return None
    return min([physical, *_cgroup_limits()])


def _cgroup_limits() -> list[int]:
    """The memory limits of this process's cgroup and its ancestors (v2 and v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            root, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        folder = root / group.lstrip("/")
        for candidate in (folder, *folder.parents):
            try:
                text = (candidate / name).read_text().strip()
            except OSError:
                text = ""
            if text.isdigit() and int(text) < 2**62:  # "max" or ~2**63: no limit
                limits.append(int(text))
            if candidate == root:
                break
    return limits


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
