"""A user's loop as the planner sees it: a Profile from one timed step and its saved tensors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.profile import LayerProfile, Profile, SavedTensor, StepMemory
from pipeswap.profiling.saved import CapturedSavedTensor
from pipeswap.profiling.step import dtype_name, optimizer_state_bytes
from pipeswap.swap.runtime.recompute_sizes import RecomputeSizes

__all__ = ["loop_profile", "saved_tensors"]


def loop_profile(
    model: nn.Module,
    layers: dict[str, nn.Module],
    sizes: RecomputeSizes,
    timing: BlockTiming,
    call: tuple[Any, Any],
    *,
    optimizer: str,
    memory: StepMemory | None,
    outputs_held: bool = False,
) -> Profile:
    """The planner's view of one shape: each layer's times, saved tensors (``sizes``'s
    records) and parameters (those outside the layers count with the first, as resident
    memory), what recomputing each keeps and saves again (``sizes``: whole, and
    selectively where its choices say how), and
    what the meter read during the timed step (a step learnt with its saved tensors on the
    host reads as the step as it is, pipeswap.profiling.on_host; its copies back are out
    of its times, BlockTiming.copies).

    ``outputs_held``: the loop holds the model's outputs through the backward
    (loop_calls.HeldOutputs), so a saved storage that is one of them (``returned``: the
    attention maps a model returns and its next matmul saves, a hidden state the next
    layer saves) stays on the device whatever a plan does: it is no saved tensor to swap
    or free by recomputing, and counts where the meter read it, in the working sets."""
    names = list(layers)
    seen: set[int] = set()
    params: dict[str, int] = {}
    for name, layer in layers.items():
        params[name] = _new_bytes(layer.parameters(), seen)
    params[names[0]] += _new_bytes(model.parameters(), seen)
    backward_s = timing.backward_s(names)
    profiled = tuple(
        LayerProfile(
            name=name,
            forward_s=timing.forward_s[name],
            backward_s=backward_s[name],
            param_bytes=params[name],
            output_bytes=timing.output_bytes.get(name, 0),
            saved=saved_tensors(sizes.records[name], outputs_held=outputs_held),
            **sizes.profile_fields(name, timing.forward_s[name]),
        )
        for name in names
    )
    first = next((t for t in tree_flatten(call)[0] if isinstance(t, torch.Tensor)), None)
    total = sum(params.values())
    parameter = next(model.parameters())
    return Profile(
        model=_model_name(model),
        batch=int(first.shape[0]) if first is not None and first.dim() else 1,
        dtype=dtype_name(parameter.dtype),
        source="measured",
        device=parameter.device.type,
        optimizer=optimizer,
        optimizer_state_bytes=optimizer_state_bytes(optimizer, total),
        layers=profiled,
        notes={"source": "pipeswap.offload: one step of the user's loop, timed by hooks"},
        memory=memory,
    )


def saved_tensors(
    records: Iterable[CapturedSavedTensor], *, outputs_held: bool
) -> tuple[SavedTensor, ...]:
    """A layer's saved tensors as a profile lists them: those the loop keeps on the device
    anyway left out: the tensors it called the model with (``given``: its batch, the
    ``inputs_embeds`` it made), its outputs where it holds them (``returned``, with
    ``outputs_held``), and those the model's own code held past the next layer's forward
    (``kept_alive``: a swap of one frees nothing, and the meter reads it in the working
    sets)."""
    return tuple(SavedTensor(r.index, r.bytes) for r in records if not r.held_anyway(outputs_held))


def _new_bytes(params: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _model_name(model: nn.Module) -> str:
    name = getattr(model, "name", None)
    return name if isinstance(name, str) else type(model).__name__
