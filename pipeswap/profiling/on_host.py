"""Every saved tensor on the host: a step within the memory of a plan that swaps them all.

A profile needs a step of the model, and run as it is that step holds the no-swap peak
that a budget exists to avoid. Run inside :func:`every_saved_tensor_on_host` it keeps only
what a plan that swaps every layer's saved tensors would keep: each storage a layer saves
goes to host memory when the layer's forward ends (copied whole, as plans swap storages)
and all of a layer's come back when its backward starts, each let go of once its last
tensor is used; parameters and buffers stay. A meter's marks in the step's timing are
told, as it happens, of every saved storage the device no longer holds and the step as it
is would (``MemoryMarks.shift``: when its last holder on the device lets it go, and
before its copy back), so each interval's peak is the step's as it is, exactly; and no
layer is run twice. The copies back are timed apart (``BlockTiming.copies``), or made
before a layer's backward is timed (:meth:`SavedOnHost.bring_back`). Results are the step's as it is, bit for bit: a copy to
host and back changes no value.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from itertools import chain
from typing import Any, cast

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from pipeswap.precision import drop_cached_casts
from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.cast_twins import CastTwins
from pipeswap.profiling.meter import host_buffer
from pipeswap.profiling.saved import storage_key
from pipeswap.profiling.saved_versions import SavedVersions

__all__ = ["SavedOnHost", "every_saved_tensor_on_host"]


class _OnHost:
    """One saved storage in host memory (whole, as plans swap it), its copy back on the
    device while it is due, and how many of the tensors saved on it are still to be used.

    ``away`` while the device holds it nowhere and the step as it is would (its original
    let go of, no copy back yet): its owner's ``shift`` tells a meter's marks of each
    change."""

    __slots__ = ("away", "back", "device", "due", "gone", "host", "original", "owner", "versions")

    def __init__(
        self, storage: torch.UntypedStorage, device: torch.device, owner: SavedOnHost
    ) -> None:
        self.device = device
        self.owner = owner
        self.host: torch.Tensor | None = None
        self.back: torch.UntypedStorage | None = storage  # until its layer's forward ends
        self.original: weakref.ref[torch.UntypedStorage] | None = None
        self.due = 0
        self.away = self.gone = False
        self.versions = SavedVersions()  # (pipeswap.profiling.saved_versions)

    def flush(self) -> None:
        """Its layer's forward is over: to the host, and let go of on the device."""
        self.versions.settle()  # a change made before the copy, the backward refuses
        if self.host is None and self.back is not None:
            self.host = host_buffer(self.back.nbytes(), pin=self.device.type == "cuda")
            self.host.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.back))
            self.original = weakref.ref(self.back, self._gone)
            self.back = None  # (gone now, unless the step holds it for something else)
            self.noted()

    def _gone(self, _: object) -> None:
        # A weak reference's callback runs before the meter's own (newest first), while
        # the meter still counts the storage: the shift waits for the step's next event.
        self.gone = True
        self.owner.dying.append(self)

    def noted(self) -> None:
        """Tell the marks if the storage is gone from the device (and still owed)."""
        if self.gone and self.back is None and self.due > 0 and not self.away:
            self.away = True
            self.owner.shift(self._nbytes())

    def _nbytes(self) -> int:
        assert self.host is not None
        return self.host.numel()

    def fetch(self) -> None:
        if self.back is None:
            # Where the device still holds the storage (the step keeps it for something
            # else, a block's output), it is used as it is, as the step as it is would:
            # not copied back beside it.
            original = None if self.original is None else self.original()
            if original is not None:
                self.back = original
                return
            self.noted()
            if self.away:  # (before the copy: the two never count at once)
                self.away = False
                self.owner.shift(-self._nbytes())
            assert self.host is not None  # a copy on the CPU too, so a meter counts it
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


class SavedOnHost:
    """The step's saved storages while :func:`every_saved_tensor_on_host` runs: which
    layer is saving, what each layer saved, and what is still on the device."""

    def __init__(
        self, model: nn.Module, timing: BlockTiming | None, *, drop_casts: bool = True
    ) -> None:
        self.timing = timing
        self.resident = {storage_key(t) for t in chain(model.parameters(), model.buffers())}
        self.saving: str | None = None  # the layer whose forward runs
        self.stored: WeakIdKeyDictionary = WeakIdKeyDictionary()  # device storage -> _OnHost
        self.saved: dict[str, dict[int, _OnHost]] = {}  # per layer, the storages it saved
        self.pending: list[_OnHost] = []  # the running layer's, still on the device
        self.dying: list[_OnHost] = []  # let go of on the device since the last event
        self.twins = CastTwins()  # a repeated cast is kept once, as the swap runtime keeps it
        self.drop_casts = drop_casts  # autocast's cached casts let go of at layers' edges

    def shift(self, delta: int) -> None:
        """``delta`` more bytes the step as it is holds and the device does not, from now."""
        marks = None if self.timing is None else self.timing.marks
        if marks is not None:
            marks.shift(delta)

    def settle(self) -> None:
        """Note the storages let go of since the last event (pack, unpack, a layer's edge)."""
        while self.dying:
            self.dying.pop().noted()

    def entering(self, name: str | None) -> None:
        """Layer ``name``'s forward starts (None: the step's forward is over): the
        storages the layer before saved go to the host."""
        if self.drop_casts:  # first: a flushed storage the cache held would stay
            drop_cached_casts()
        self.settle()
        self.twins.reset()
        for entry in self.pending:
            entry.flush()
        self.pending.clear()
        self.saving = name

    def bring_back(self, name: str) -> None:
        """Layer ``name``'s backward starts: all of its storages come back (timed apart)."""
        self.settle()
        group = self.saved.pop(name, None)
        if group:
            _fetch(list(group.values()), self.timing)

    def pack(self, tensor: torch.Tensor) -> object:
        self.settle()
        layer = self.saving
        if (
            layer is None
            or type(tensor) is not torch.Tensor  # a subclass (DTensor, float8) keeps its kind
            or tensor.layout != torch.strided
            or storage_key(tensor) in self.resident
        ):
            return tensor.detach()  # not a saved output with its grad_fn: a cycle
        given, tensor = tensor, self.twins.share(tensor)
        storage = tensor.untyped_storage()
        entry = self.stored.get(storage)
        if entry is None:
            entry = self.stored[storage] = _OnHost(storage, tensor.device, self)
            self.pending.append(entry)
        # Each layer's group is what its backward uses, an earlier layer's output included.
        self.saved.setdefault(layer, {})[id(entry)] = entry
        entry.due += 1
        entry.versions.note(given)
        view = (tensor.size(), tensor.stride(), tensor.storage_offset())
        return (layer, entry, tensor.dtype, view)

    def unpack(self, packed: object) -> torch.Tensor:
        self.settle()
        if isinstance(packed, torch.Tensor):
            return packed
        layer, entry, dtype, view = cast(tuple[str, _OnHost, torch.dtype, tuple[Any, ...]], packed)
        entry.versions.check()
        self.bring_back(layer)  # the first of the layer's to be used
        return entry.unpack(dtype, view)


@contextmanager
def every_saved_tensor_on_host(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    timing: BlockTiming | None = None,
    *,
    drop_casts: bool = True,
) -> Iterator[SavedOnHost]:
    """Every storage a layer of ``layers`` saves a tensor on for the backward, but
    ``model``'s parameters and buffers, is copied whole to host memory no meter counts
    (pinned for a GPU) when the layer's forward ends (until then the device holds what the
    step as it is holds); it holds none of them again until a layer's backward needs one,
    when all of that layer's come back at once (their copies noted in ``timing``) and each
    is let go of once its last tensor is used, as the step as it is holds them then. What
    the model saves before the first layer (its embeddings' input) stays where it is; what
    it saves after the last (its head, its loss) goes with the last layer's.

    ``drop_casts``: autocast's cached weight casts are let go of at each layer's edge, as
    a swapping step lets go of them (a cast then lives as long as its layer's forward or
    autograd keeps it, and goes to the host with its layer's); off, the cache holds every
    cast on the device as in a plain step under autocast, whose readings the step then
    gives (what ``measure`` profiles)."""
    on_host = SavedOnHost(model, timing, drop_casts=drop_casts)
    # First of the hooks: a meter read at the layers' edges reads them flushed. What runs
    # after the last layer (the head, the loss) is the last layer's, as profiles count it.
    handles = [
        layer.register_forward_pre_hook(lambda *_, name=name: on_host.entering(name), prepend=True)
        for name, layer in layers.items()
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(on_host.pack, on_host.unpack):
            yield on_host
    finally:
        on_host.entering(None)
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
