"""A user's loop as the planner sees it: a Profile from one timed step and its saved tensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.profile import LayerProfile, Profile, SavedTensor, StepMemory
from pipeswap.profiling.step import dtype_name, optimizer_state_bytes
from pipeswap.swap.runtime.recompute import RecomputeSizes
from pipeswap.swap.runtime.selective import SelectiveChoice

__all__ = ["as_plain", "loop_profile"]


def loop_profile(
    model: nn.Module,
    layers: dict[str, nn.Module],
    records: dict[str, Any],
    timing: BlockTiming,
    call: tuple[Any, Any],
    *,
    optimizer: str,
    memory: StepMemory | None,
    kept: dict[str, int],
    rerun: dict[str, int],
    choices: Mapping[str, SelectiveChoice] | None = None,
    learnt: str = "as-is",
) -> Profile:
    """The planner's view of one shape: each layer's times, saved tensors and parameters
    (those outside the layers count with the first, as resident memory), what recomputing
    each keeps and saves again (whole, and selectively where ``choices`` says how), and
    what the meter read during the timed step.

    ``learnt``: how the timed step ran (pipeswap.swap.runtime.learning.LEARNT_BY); a step
    that recomputed every layer has each layer's backward told less its forward (its
    re-run); the meter's readings are made those of the step run as it is
    (:func:`as_plain`). A step that saved on the host keeps its times, copies included."""
    names = list(layers)
    seen: set[int] = set()
    params: dict[str, int] = {}
    for name, layer in layers.items():
        params[name] = _new_bytes(layer.parameters(), seen)
    params[names[0]] += _new_bytes(model.parameters(), seen)
    backward_s = timing.backward_s(names)
    sizes = RecomputeSizes(records, kept, rerun, dict(choices or {}))
    if learnt == "recomputing":
        backward_s = {n: max(0.0, s - timing.forward_s[n]) for n, s in backward_s.items()}
    if memory is not None and learnt != "as-is":
        memory = as_plain(memory, sizes, names, learnt)
    profiled = tuple(
        LayerProfile(
            name=name,
            forward_s=timing.forward_s[name],
            backward_s=backward_s[name],
            param_bytes=params[name],
            output_bytes=timing.output_bytes.get(name, 0),
            saved=tuple(SavedTensor(r.index, r.bytes) for r in records[name]),
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


def as_plain(
    memory: StepMemory, sizes: RecomputeSizes, names: list[str], learnt: str
) -> StepMemory:
    """What the meter would have read in the step run as it is, from its readings of a
    step that was ``learnt`` recomputing every layer or with every saved tensor on the host.

    Up to layer i, the step run as it is holds every layer's saved tensors where the learnt
    step held each layer's input (recomputing: its ``kept`` bytes) or none of the earlier
    layers' (on the host, which holds layer i's own until it ends). In layer i's backward the learnt
    step held layer i's saved tensors again (its re-run's saves, or all of them fetched
    back). Each reading moves by the difference. A forward's working set read this way
    errs high: what a layer's code held counts whether or not autograd kept it too."""
    recomputing = learnt == "recomputing"
    saved = held = 0
    forward, backward = [], []
    for name, f_peak, b_peak in zip(
        names, memory.forward_peak_bytes, memory.backward_peak_bytes, strict=True
    ):
        own = sum(r.bytes for r in sizes.records[name])
        saved += own
        held += sizes.kept.get(name, 0) if recomputing else 0
        # On the host a layer's own saves leave the device as its forward ends.
        forward.append(f_peak + saved - (held if recomputing else own))
        again = sizes.rerun.get(name, 0) if recomputing else own
        backward.append(max(memory.start_bytes, b_peak + saved - held - again))
    return replace(
        memory,
        forward_peak_bytes=tuple(forward),
        backward_peak_bytes=tuple(backward),
        # The turn holds the last layer's (with the head's) on the host too.
        turn_peak_bytes=memory.turn_peak_bytes + saved - (held if recomputing else own),
    )


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
