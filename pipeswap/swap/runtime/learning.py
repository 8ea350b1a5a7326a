"""How a shape is learnt before any plan exists: a step within the memory of a plan, timed.

A plan needs a profile of the call it serves, and the profile needs a step of that call;
run as it is, that step would hold the no-swap peak that the budget exists to avoid. So
the step that is learnt keeps only what a plan that swaps every layer's saved tensors
would keep: each storage a layer saves goes to host memory when the layer's forward ends
(copied whole, as plans swap storages) and all of a layer's come back when its backward
starts, each let go of once its last tensor is used; parameters and buffers stay. So
every reading of a meter at the layers' edges is the step's as it is less the saved
storages of the layers not running (pipeswap.training.loop_profile.as_plain adds them
back), and no layer is run twice to learn it (a layer that cannot be re-run, under a
policy that never recomputes, is not). The copies back are timed apart
(``BlockTiming.copies``): not a layer's backward. Policy ``none`` keeps everything, so
its step runs as it is. Results are the step's as it is, bit for bit: a copy to host and
back changes no value.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import chain
from typing import Any, cast

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from pipeswap.precision import uncached_casts
from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.meter import host_buffer
from pipeswap.profiling.saved import storage_key

__all__ = ["LEARNT_BY", "SAID", "every_saved_tensor_on_host", "learning_step", "learnt_by"]

# How a step that is learnt runs: as it is, or with the saved tensors on the host.
LEARNT_BY = ("as-is", "on-host")
SAID = {  # what a learnt step does, said in a step's stats
    how: f"runs {doing}, timed and metered, to plan it and every later shape "
    "(offload.plan_for(...) before the loop plans it)"
    for how, doing in (
        ("as-is", "as it is"),
        ("on-host", "with every saved tensor on the host"),
    )
}


def learnt_by(policy: str) -> str:
    """How a shape is learnt under swap policy ``policy`` (one of :data:`LEARNT_BY`)."""
    return "as-is" if policy == "none" else "on-host"


def learning_step(
    how: str,
    model: nn.Module,
    layers: dict[str, nn.Module],
    timing: BlockTiming | None = None,
) -> AbstractContextManager[None]:
    """The context a learnt step's forward runs in (``how``: one of :data:`LEARNT_BY`);
    its copies back are noted in ``timing``."""
    if how == "on-host":
        return every_saved_tensor_on_host(model, layers, timing)
    return nullcontext()


class _OnHost:
    """One saved storage in host memory (whole, as plans swap it), its copy back on the
    device while it is due, and how many of the tensors saved on it are still to be used."""

    __slots__ = ("back", "device", "due", "host")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        self.device = device
        self.host: torch.Tensor | None = None
        self.back: torch.UntypedStorage | None = storage  # until its layer's forward ends
        self.due = 0

    def flush(self) -> None:
        """Its layer's forward is over: to the host, and let go of on the device."""
        if self.host is None and self.back is not None:
            self.host = host_buffer(self.back.nbytes(), pin=self.device.type == "cuda")
            self.host.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.back))
            self.back = None

    def fetch(self) -> None:
        if self.back is None:  # a copy on the CPU too, so a meter counts what a GPU holds
            assert self.host is not None
            self.back = self.host.to(self.device, copy=True).untyped_storage()

    def unpack(self, dtype: torch.dtype, view: tuple[Any, ...]) -> torch.Tensor:
        self.fetch()  # (again, where a graph kept for a second backward runs it)
        back = self.back
        assert back is not None
        self.due -= 1
        if self.due <= 0:  # the last tensor saved on it: let it go once that one is
            self.back = None
        size, stride, offset = view
        return torch.empty(0, dtype=dtype, device=self.device).set_(back, offset, size, stride)


@contextmanager
def every_saved_tensor_on_host(
    model: nn.Module, layers: dict[str, nn.Module], timing: BlockTiming | None = None
) -> Iterator[None]:
    """Every storage a layer of ``layers`` saves a tensor on for the backward, but
    ``model``'s parameters and buffers, is copied whole to host memory no meter counts
    (pinned for a GPU) when the layer's forward ends (until then the device holds what the
    step as it is holds); it holds none of them again until a layer's backward needs one,
    when all of that layer's come back at once and each is let go of once its last tensor
    is used, as the step as it is holds them then. What the model saves before the first
    layer (its embeddings' input) stays where it is; what it saves after the last (its
    head, its loss) goes with the last layer's."""
    resident = {storage_key(t) for t in chain(model.parameters(), model.buffers())}
    saving: list[str | None] = [None]  # the layer whose forward runs
    stored: WeakIdKeyDictionary = WeakIdKeyDictionary()  # device storage -> _OnHost
    saved: dict[str, list[_OnHost]] = {}  # per layer, the storages it saved first
    pending: list[_OnHost] = []  # the running layer's, still on the device

    def entering(name: str | None) -> None:
        for entry in pending:
            entry.flush()
        pending.clear()
        saving[0] = name

    def pack(tensor: torch.Tensor) -> object:
        layer = saving[0]
        if (
            layer is None
            or type(tensor) is not torch.Tensor  # a subclass (DTensor, float8) keeps its kind
            or tensor.layout != torch.strided
            or storage_key(tensor) in resident
        ):
            return tensor
        storage = tensor.untyped_storage()
        entry = stored.get(storage)
        if entry is None:
            entry = stored[storage] = _OnHost(storage, tensor.device)
            saved.setdefault(layer, []).append(entry)
            pending.append(entry)
        entry.due += 1
        view = (tensor.size(), tensor.stride(), tensor.storage_offset())
        return (layer, entry, tensor.dtype, view)

    def unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        layer, entry, dtype, view = cast(tuple[str, _OnHost, torch.dtype, tuple[Any, ...]], packed)
        group = saved.pop(layer, None)
        if group:  # the layer's backward starts: all come back
            _fetch(group, timing)
        return entry.unpack(dtype, view)

    # First of the hooks: a meter read at the layers' edges reads them flushed. What runs
    # after the last layer (the head, the loss) is the last layer's, as profiles count it.
    handles = [
        layer.register_forward_pre_hook(lambda *_, name=name: entering(name), prepend=True)
        for name, layer in layers.items()
    ]
    try:
        with uncached_casts(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        entering(None)
        for handle in handles:
            handle.remove()


def _fetch(group: list[_OnHost], timing: BlockTiming | None) -> None:
    """Copy a layer's storages back, timed apart from its backward (``timing.copies``)."""
    device = group[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for entry in group:
        entry.fetch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if timing is not None:
        timing.copies.append((started, time.perf_counter() - started))
