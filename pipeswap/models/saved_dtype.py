"""A Hugging Face model saved in the precision it came in: its directory said bfloat16 or
float16, pipeswap trained float32 master weights, and the save casts them back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from pipeswap.jsonio import dump_json

__all__ = ["cast_state", "source_dtype", "stamp_dtype"]

# The half precisions a config's dtype may name; float32 (or none named) is saved as trained.
_HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# transformers 5 writes "dtype", earlier versions "torch_dtype".
_KEYS = ("dtype", "torch_dtype")


def source_dtype(source: str) -> torch.dtype | None:
    """The half precision the weights in the model directory ``source`` were saved in
    (its config.json says so), None for float32, an unnamed one, or no directory."""
    config = Path(source) / "config.json"
    if not os.path.isdir(source) or not config.is_file():
        return None
    try:
        named = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    for key in _KEYS:
        value = named.get(key) if isinstance(named, dict) else None
        if isinstance(value, str) and value in _HALF:
            return _HALF[value]
    return None


def cast_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``model``'s state dict on the CPU with its floating tensors in ``dtype``; tensors
    that share a storage (tied weights) share one cast, so the save keeps one copy."""
    cast: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in cast:
            moved = tensor.detach().to("cpu")
            cast[key] = moved.to(dtype) if moved.is_floating_point() else moved
        state[name] = cast[key]
    return state


def stamp_dtype(config_path: Path, dtype: torch.dtype) -> None:
    """Name ``dtype`` in a saved config.json (save_pretrained names the model's own)."""
    config = json.loads(config_path.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in _KEYS:
        if key in config:
            config[key] = name
    dump_json(config_path, config)
