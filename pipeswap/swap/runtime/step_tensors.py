"""One step's saved tensors: each pack call named as prepare named it, kept or swapped.

Autograd's pack hook hands every tensor a layer saves to :meth:`StepTensors.pack`, which
names it by its position among the layer's pack calls (the names prepare learned) and
wraps it: a :class:`HeldTensor` stays on the device, a :class:`SwappedHandle` is one the
plan moves to host memory. :meth:`unpack` gives autograd the tensor back, fetching one
whose prefetch was not issued yet (a late fetch). Parameters and buffers pass through.

A forward that does not save the same tensors every step (a mixture of experts routes
tokens anew each step; an expert that gets none saves nothing) cannot be named by
position. ``strict`` refuses it; otherwise every tensor whose name does not fit (an
extra pack call, another size, another storage under a name already used this step)
stays on the device, a planned swap of a tensor the step did not save is skipped, and
``unmatched`` counts them: the plan then saves less memory, never a different result.
"""

from __future__ import annotations

import warnings
from collections.abc import Container
from typing import Any

import torch

from pipeswap.errors import PipeswapError
from pipeswap.precision import drop_cached_casts
from pipeswap.profiling.cast_twins import CastTwins
from pipeswap.profiling.saved_versions import SavedVersions
from pipeswap.swap.plan import SwapDecision
from pipeswap.swap.plan.tensors import SavedKey
from pipeswap.swap.runtime.transfer import (
    COPYING_OUT,
    GONE,
    ON_DEVICE,
    DeviceLedger,
    HeldTensor,
    SavedTensorState,
    SwappedHandle,
    SwapTransfer,
    bytes_of_storage,
)

__all__ = ["StepTensors", "only_swapped"]


class StepTensors:
    """The saved tensors of one step and what moved: ``swapped``, ``prefetched`` (bytes)
    and ``late`` (fetches) this step, ``late_total`` and ``swapped_total`` over all steps."""

    def __init__(
        self,
        decisions: dict[SavedKey, SwapDecision],
        transfer: SwapTransfer,
        ledger: DeviceLedger,
        *,
        strict: bool = True,
        lane: int | None = None,
    ) -> None:
        self.decisions = decisions
        # Several in-flight units swap the same names: each unit's copies go to the host
        # pool's regions (lane, layer, index) of the lane it holds (pipeswap.swap.runtime.unit_swapper).
        self.lane = lane
        self.strict = strict
        self.unmatched = 0  # tensors kept or swaps skipped because their names did not fit
        self.transfer = transfer
        self.retained_warned = False  # put_back's warning, given once
        self.ledger = ledger
        self.pack_calls: dict[str, list[SavedKey | None]] = {}
        self.sizes: dict[SavedKey, int] = {}
        # A repeated cast is kept once (as prepare's naming pass kept it): matched per layer.
        self.twins = CastTwins()
        self._layer: str | None = None
        self._entered: set[str] = set()  # this step's layers so far
        self._backward_done: set[str] = set()  # this step's layers whose backward is done
        self._runs: dict[str, int] = {}  # this step's forwards of each layer, less backwards
        self._fresh: list[SavedVersions] = []  # saved since the last layer edge
        self._warned = False
        self._calls: dict[str, int] = {}
        self._entries: dict[SavedKey, SavedTensorState] = {}
        self.swapped = self.prefetched = self.late = 0
        self.late_total = self.swapped_total = 0

    @property
    def layer(self) -> str | None:
        """The layer whose forward is running."""
        return self._layer

    @layer.setter
    def layer(self, name: str | None) -> None:
        """A layer's edge (None: the forward's end)."""
        self._layer = name
        for versions in self._fresh:  # a block's output changed in place by the code after it
            versions.settle(done=False)
        self._fresh.clear()
        self.twins.reset()
        drop_cached_casts()
        if name is not None:
            if name in self._entered and not self._warned and _autocast_caching():
                self._warned = True
                warnings.warn(
                    f"layer {name!r} runs more than once in a forward: under autocast each "
                    "call casts its weights anew (autocast's cache is let go of at every "
                    "layer's edge), so its weights' gradients may differ in their last bits "
                    "from a loop without pipeswap",
                    stacklevel=2,
                )
            self._entered.add(name)
            self._runs[name] = self._runs.get(name, 0) + 1

    def start_step(self, layer_names: list[str]) -> None:
        self._entries = {}
        self._calls = dict.fromkeys(layer_names, 0)
        self.layer = None
        self._entered = set()
        self._backward_done = set()
        self._runs = {}
        self.twins.shared_bytes = 0  # this step's
        self.swapped = self.prefetched = self.late = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        layer = self.layer
        if layer is None:
            # Detached, as everything this hook keeps as it is: a saved output kept with
            # its grad_fn is a cycle through C++ that a forward with no backward never frees.
            return tensor.detach()
        given, tensor = tensor, self.twins.share(tensor)
        call = self._calls[layer]
        self._calls[layer] = call + 1
        try:
            key = self.pack_calls[layer][call]
        except IndexError:
            if not self.strict:
                return self._unmatched(tensor)
            raise PipeswapError(
                f"layer {layer!r} saved more tensors than in the prepare() pass; a step must "
                "run the same forward and shapes as the one prepare() was given"
            ) from None
        if key is None:  # a parameter or buffer: always resident, never swapped
            return tensor.detach()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, tensor)
            if entry is None:
                return self._unmatched(tensor)
        elif not self.strict and not _holds(entry, tensor):
            return self._unmatched(tensor)
        entry.versions.note(given)
        self._fresh.append(entry.versions)
        if entry.swapped:
            return SwappedHandle(self.transfer, entry, tensor, layer)
        return HeldTensor(self.transfer, entry, tensor, layer)

    def _unmatched(self, tensor: torch.Tensor) -> torch.Tensor:
        self.unmatched += 1
        return tensor.detach()

    def _new_entry(self, key: SavedKey, tensor: torch.Tensor) -> SavedTensorState | None:
        if key in self.decisions:
            storage = bytes_of_storage(tensor)
            planned = self.decisions[key].bytes
            if storage.numel() > planned or (self.strict and storage.numel() != planned):
                if not self.strict:
                    return None
                raise PipeswapError(
                    f"tensor {key} has {storage.numel()} bytes in this step but "
                    f"{planned} in the plan; steps must keep their shapes"
                )
            # Without strict, a smaller call the plan covers (pipeswap.training.loop_shapes)
            # swaps a smaller tensor into the front of its region.
            pool_key = key if self.lane is None else (self.lane, *key)
            entry = SavedTensorState(pool_key, storage.numel(), True, storage)
        else:
            entry = SavedTensorState(key, self.sizes[key], False, None)
        self._entries[key] = entry
        self.ledger.grow(entry.bytes)
        return entry

    def unpack(self, handle: Any) -> torch.Tensor:
        if type(handle) is HeldTensor:
            handle.entry.versions.check()
            return handle.tensor
        if type(handle) is not SwappedHandle:
            return handle
        entry = handle.entry
        entry.versions.check()
        if self.transfer.ready(entry):
            self.late_total += 1
            self.late += 1
            self.prefetched += entry.bytes
        assert entry.device is not None
        rebuilt = torch.empty(0, dtype=handle.dtype, device=entry.device.device)
        # The bytes start where entry.device does in its storage (a host region on the CPU).
        start = entry.device.storage_offset() // handle.dtype.itemsize
        return rebuilt.set_(
            entry.device.untyped_storage(), start + handle.offset, handle.size, handle.stride
        )

    def put_back(self, layer: str) -> None:
        """Layer ``layer``'s backward is done: swapped tensors that autograd still holds
        for layers whose backward is done (a retained graph) go back to the host. A layer
        the forward ran several times is done at the backward of its first run."""
        self._runs[layer] = self._runs.get(layer, 1) - 1
        if self._runs[layer] > 0:
            return
        done = self._backward_done
        done.add(layer)
        retained = False
        for entry in self._entries.values():
            if entry.refs > 0 and done.issuperset(entry.holders):
                retained = True
                if entry.swapped:
                    self.transfer.put_back(entry)
        if retained and not self.retained_warned:
            self.retained_warned = True
            warnings.warn(
                "a backward kept its graph (backward(retain_graph=True)): autograd holds every "
                "tensor the step saved until the graph is freed, and those the plan keeps on "
                "the device stay there, so such steps hold more than the plan's budget (the "
                "swapped ones go back to the host); a smaller budget, or one backward of the "
                "summed losses, keeps them within it",
                RuntimeWarning,
                stacklevel=2,
            )

    def swap_out(self, key: SavedKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.state == GONE:
            # Saved, then let go before its swap-out: an op whose result the forward dropped
            # (a model's head re-running its embeddings, whose output its blocks' stubs
            # drop). Nothing is left to move.
            return
        if entry is None or entry.state != ON_DEVICE:
            if not self.strict:
                self.unmatched += 1
                return
            raise PipeswapError(
                f"the plan swaps tensor {key} out but this step did not save it; prepare() "
                "must see the same forward as the steps"
            )
        entry.versions.settle()  # a change made before the copy, the backward refuses
        self.transfer.swap_out(entry)
        self.swapped_total += entry.bytes
        self.swapped += entry.bytes

    def holds_one_of(self, key: SavedKey, pointers: set[int]) -> bool:
        """Whether ``key``'s storage (on the device) is one of those at ``pointers``."""
        entry = self._entries.get(key)
        return (
            entry is not None
            and entry.device is not None
            and entry.device.untyped_storage().data_ptr() in pointers
        )

    def copying(self) -> bool:
        """Whether a swap-out of this step's is still copying (its device bytes held)."""
        return any(entry.state == COPYING_OUT for entry in self._entries.values())

    def prefetch(self, key: SavedKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and self.transfer.prefetch(entry):
            self.prefetched += entry.bytes


def _holds(entry: SavedTensorState, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of the storage ``entry`` still holds on the device (a
    kept entry holds no storage of its own: any tensor under its name stays as it is)."""
    if not entry.swapped:
        return True
    return (
        entry.state == ON_DEVICE
        and entry.device is not None
        and entry.device.data_ptr() == tensor.untyped_storage().data_ptr()
    )


def _autocast_caching() -> bool:
    """Whether autocast, with its weight-cast cache, is on for a CPU or a CUDA forward."""
    return torch.is_autocast_cache_enabled() and any(
        torch.is_autocast_enabled(device) for device in ("cpu", "cuda")
    )


def only_swapped(
    pack_calls: dict[str, list[SavedKey | None]], swapped: Container[SavedKey]
) -> dict[str, list[SavedKey | None]]:
    """``pack_calls`` naming only the swapped tensors: without accounting, tensors that
    stay need no bookkeeping and pass straight on."""
    return {
        layer: [key if key in swapped else None for key in keys]
        for layer, keys in pack_calls.items()
    }
