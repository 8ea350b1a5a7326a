"""State a layer keeps past its forward: a tensor carrying the autograd graph left on a module.

A layer whose forward stores such a tensor on one of its modules (a recurrent block's
``self.recurrent_states``) keeps that graph, and every tensor the graph saved, until the
attribute is set again by the next forward. Recomputing the layer frees nothing: the
re-run in the backward makes a graph of its own, stored the same way, whose saved tensors
then stay from the layer's backward to the next step's forward instead of going with the
backward, so the re-runs of such layers pile up through the backward (the meter and HF's
own gradient checkpointing read the same). The capture's plain pass notes these
attributes per layer (:func:`graph_tensors` before the forward, :func:`set_during` after),
the profile keeps them (``LayerProfile.held_state``) and the planner never recomputes such
a layer (``pipeswap.swap.plan.workload.Workload.held_state``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["graph_tensors", "set_during"]

# A module's own bookkeeping: parameters and buffers are no state a forward keeps.
_OWN = frozenset({"_parameters", "_buffers", "_modules"})

Held = dict[str, "weakref.ref[torch.Tensor]"]


def graph_tensors(layer: nn.Module) -> Held:
    """Per attribute (``sub.attr``, ``attr[0]``, ``attr['key']``), each tensor that carries
    a graph (``grad_fn``) held by ``layer`` or a submodule outside its parameters and
    buffers, in a plain attribute or one level inside a list, tuple or dict."""
    found: Held = {}
    for prefix, module in layer.named_modules(remove_duplicate=True):
        for key, value in vars(module).items():
            if key in _OWN:
                continue
            path = f"{prefix}.{key}" if prefix else key
            for where, item in _items(path, value):
                if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                    found[where] = weakref.ref(item)
    return found


def set_during(layer: nn.Module, before: Held) -> tuple[str, ...]:
    """The attributes of ``layer`` holding a tensor that carries a graph which they did not
    hold ``before`` its forward (:func:`graph_tensors` then): state its forward kept."""
    return tuple(
        sorted(
            where
            for where, held in graph_tensors(layer).items()
            if where not in before or before[where]() is not held()
        )
    )


def _items(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    yield path, value
    if isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            yield f"{path}[{k}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}[{key!r}]", item
