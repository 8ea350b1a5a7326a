"""SwapTransfer: moves swapped storages to a host pool and back on side streams, event-guarded.

The stream rules, on CUDA (on the CPU every stream and event is a no-op and they hold
trivially):

- A swap-out runs on the copy-out stream after that stream waits for the compute stream
  (the tensor's producer must have finished). The transfer keeps the device bytes alive
  until the copy's event has completed, and only then lets them go: no ``record_stream``
  is needed because the last reference is dropped after the copy is known to be done.
- A prefetch allocates its device bytes on the compute stream (which uses and frees
  them), makes the copy-in stream wait for the compute stream (the block may have been
  freed there a moment ago), copies on the copy-in stream and records an event; the
  compute stream waits on that event before the tensor is first used. A tensor needed
  before its prefetch was issued is copied synchronously on the compute stream (late).
- A host region is written again only after the copy that last read it: the next step's
  swap-out into a region waits on the event of the prefetch that read the region.
- A host region is never written over while its bytes are still to be read: a swap-out
  into a region whose last tensor a backward has yet to fetch (a second forward before the
  first one's backward) brings that tensor back to the device first, and warns once.
- Bytes whose copy may still be in flight are never released without synchronizing on
  that copy's event first.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Hashable

import torch

from pipeswap.profiling.saved_versions import SavedVersions
from pipeswap.streams import (
    AnyEvent,
    AnyStream,
    current_stream,
    is_cuda,
    new_stream,
    record_event,
    use_stream,
    wait_event,
    wait_stream,
)
from pipeswap.swap.runtime.pool import HostPool

__all__ = [
    "DeviceLedger",
    "HeldTensor",
    "SavedTensorState",
    "SwapTransfer",
    "SwappedHandle",
    "bytes_of_storage",
]

# Where a saved storage is: its life through one step.
ON_DEVICE, COPYING_OUT, ON_HOST, FETCHING, BACK, GONE = range(6)


class SavedTensorState:
    """Where one saved tensor (its whole storage) is during one step, and who still holds it."""

    __slots__ = (
        "key",
        "bytes",
        "swapped",
        "state",
        "device",
        "event",
        "refs",
        "holders",
        "versions",
    )

    def __init__(
        self, key: Hashable, bytes: int, swapped: bool, device: torch.Tensor | None
    ) -> None:
        self.key = key
        self.bytes = bytes
        self.swapped = swapped
        self.state = ON_DEVICE
        self.device: torch.Tensor | None = device  # [bytes] uint8 over the whole storage
        self.event: AnyEvent | None = None  # the copy that last read or wrote ``device``
        self.refs = 0
        self.holders: dict[str, int] = {}  # the layers whose saved tensors hold it: how many
        self.versions = SavedVersions()  # (pipeswap.profiling.saved_versions)


class DeviceLedger:
    """Bytes of saved tensors held on the device: now, the current step's most, the run's."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.step_peak_bytes = 0
        self.peak_bytes = 0

    def grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.step_peak_bytes:
            self.step_peak_bytes = self.live_bytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def shrink(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def start_step(self) -> None:
        self.step_peak_bytes = self.live_bytes


class HeldTensor:
    """What autograd keeps for a tensor that stays on the device: the tensor itself, plus
    a finalizer that tells the transfer when autograd lets go of it."""

    __slots__ = ("transfer", "entry", "tensor", "layer")

    def __init__(
        self, transfer: SwapTransfer, entry: SavedTensorState, tensor: torch.Tensor, layer: str
    ) -> None:
        self.transfer = transfer
        self.entry = entry
        # Detached: a saved output's grad_fn would keep this holder alive through C++, a
        # cycle Python's collector cannot see, and a forward with no backward would leak.
        self.tensor = tensor.detach()
        self.layer = layer
        _hold(entry, layer)

    def __del__(self) -> None:
        _let_go(self.transfer, self.entry, self.layer)


class SwappedHandle:
    """What autograd keeps for a view of a swapped storage: how to rebuild it from bytes."""

    __slots__ = ("transfer", "entry", "dtype", "offset", "size", "stride", "layer")

    def __init__(
        self, transfer: SwapTransfer, entry: SavedTensorState, tensor: torch.Tensor, layer: str
    ) -> None:
        self.transfer = transfer
        self.entry = entry
        self.layer = layer
        _hold(entry, layer)
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tensor.size()
        self.stride = tensor.stride()

    def __del__(self) -> None:
        _let_go(self.transfer, self.entry, self.layer)


def _hold(entry: SavedTensorState, layer: str) -> None:
    entry.refs += 1
    entry.holders[layer] = entry.holders.get(layer, 0) + 1


def _let_go(transfer: SwapTransfer, entry: SavedTensorState, layer: str) -> None:
    entry.refs -= 1
    left = entry.holders[layer] - 1
    if left:
        entry.holders[layer] = left
    else:
        del entry.holders[layer]
    if entry.refs == 0:
        transfer.forget(entry)


def bytes_of_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor over the whole storage behind ``tensor``."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _copy(destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool) -> None:
    # Every byte the transfer moves goes through here: one place for tests to observe.
    destination.copy_(source, non_blocking=non_blocking)


class SwapTransfer:
    """Copies entries between ``device`` and their regions of ``pool``, counting in ``ledger``."""

    def __init__(self, pool: HostPool, device: torch.device, ledger: DeviceLedger) -> None:
        self.pool = pool
        self.device = device
        self.ledger = ledger
        self.out_stream: AnyStream = new_stream(device)
        self.in_stream: AnyStream = new_stream(device)
        self._pending_out: deque[SavedTensorState] = deque()
        # Per region, the event of the prefetch that last read it, until a swap-out into that
        # region has been ordered after it.
        self._region_readers: dict[Hashable, AnyEvent] = {}
        # Per region, the entry whose bytes it holds (or is receiving).
        self._region_owners: dict[Hashable, SavedTensorState] = {}
        self.rescued = 0  # tensors brought back because a later swap-out needed their region

    def swap_out(self, entry: SavedTensorState) -> None:
        """Start copying ``entry`` (on the device) into its host region."""
        assert entry.state == ON_DEVICE and entry.device is not None
        owner = self._region_owners.get(entry.key)
        if owner is not None and owner is not entry and owner.state in (COPYING_OUT, ON_HOST):
            self._rescue(owner)
        self._region_owners[entry.key] = entry
        out = self.out_stream
        if not is_cuda(out):  # the CPU: the copy is done when the call returns
            _copy(self.pool.region(entry.key, entry.bytes), entry.device, non_blocking=False)
            entry.device = None
            entry.state = ON_HOST
            self.ledger.shrink(entry.bytes)
            return
        wait_stream(out, current_stream(self.device))  # the producer must have finished
        reader = self._region_readers.pop(entry.key, None)
        if reader is not None:
            wait_event(out, reader)  # the last prefetch from this region must have read it
        with use_stream(out):
            _copy(self.pool.region(entry.key, entry.bytes), entry.device, non_blocking=True)
        entry.event = record_event(out)
        entry.state = COPYING_OUT
        self._pending_out.append(entry)

    def _rescue(self, owner: SavedTensorState) -> None:
        """Keep on the device the bytes of ``owner``, whose region another swap-out is about
        to write: autograd still holds it, and its backward has not read it yet."""
        if self.rescued == 0:
            warnings.warn(
                "a forward swapped a tensor into host memory that an earlier forward's "
                "backward has yet to read (two forwards before one backward, e.g. a loss over "
                "two views): the earlier tensors were brought back to the device first, so "
                "this step holds more than its plan's budget; run one forward over the "
                "concatenated inputs, or call backward before the next forward, to keep it",
                stacklevel=4,
            )
        self.rescued += 1
        if owner.state == COPYING_OUT:
            owner.state = BACK  # the copy has not finished: the device bytes never left
        else:
            self._fetch(owner, late=True)

    def poll(self) -> None:
        """Release the device bytes of every swap-out whose copy has completed."""
        pending = self._pending_out
        while pending:
            entry = pending[0]
            if entry.state == COPYING_OUT:
                assert entry.event is not None
                if not entry.event.query():
                    return  # one stream: later copies finish later
                entry.device = None
                entry.event = None
                entry.state = ON_HOST
                self.ledger.shrink(entry.bytes)
            pending.popleft()

    def make_room(self, over_budget: Callable[[], bool]) -> None:
        """Wait for swap-outs, oldest first, releasing each one's device bytes, until
        ``over_budget()`` is false or none is in flight: the forward waits for memory, as
        the plan's timeline does, instead of outgrowing the budget."""
        while self._pending_out and over_budget():
            entry = self._pending_out[0]
            if entry.state == COPYING_OUT:
                assert entry.event is not None
                entry.event.synchronize()
            self.poll()

    def prefetch(self, entry: SavedTensorState) -> bool:
        """Start bringing ``entry`` back ahead of its use; True when a copy was issued."""
        if entry.state == COPYING_OUT:
            self.poll()
        if entry.state == COPYING_OUT:
            entry.state = BACK  # the copy has not finished: the device bytes never left
            return False
        if entry.state == ON_HOST:
            self._fetch(entry, late=False)
            return True
        return False

    def ready(self, entry: SavedTensorState) -> bool:
        """Make ``entry``'s device bytes safe for the compute stream to read from now on.

        True when the bytes were still on the host and had to be fetched there and then.
        """
        if entry.state == ON_HOST:
            self._fetch(entry, late=True)
            return True
        if entry.state == FETCHING:
            assert entry.event is not None
            wait_event(current_stream(self.device), entry.event)
            entry.state = BACK
        elif entry.state == COPYING_OUT:
            entry.state = BACK  # still on the device: keep it, forget the release
        return False

    def _fetch(self, entry: SavedTensorState, *, late: bool) -> None:
        self.ledger.grow(entry.bytes)
        region = self.pool.region(entry.key, entry.bytes)
        if not is_cuda(self.in_stream):
            # A copy of its own, as a GPU's: the bytes back are device memory that a meter
            # counts (the region read in place would hide them, the pool being left out).
            device = torch.empty(entry.bytes, dtype=torch.uint8, device=self.device)
            _copy(device, region, non_blocking=False)
            entry.device = device
            entry.state = BACK
            return
        compute = current_stream(self.device)
        # Allocated on the compute stream, which will read and free it.
        device = torch.empty(entry.bytes, dtype=torch.uint8, device=self.device)
        if late:
            # Synchronous: PyTorch waits for a blocking host-to-device copy to finish.
            _copy(device, region, non_blocking=False)
            entry.state = BACK
        else:
            wait_stream(self.in_stream, compute)  # the block may have been freed there just now
            with use_stream(self.in_stream):
                _copy(device, region, non_blocking=True)
            entry.event = record_event(self.in_stream)
            self._region_readers[entry.key] = entry.event
            entry.state = FETCHING
        entry.device = device

    def put_back(self, entry: SavedTensorState) -> None:
        """``entry`` was fetched for a backward that is done, and autograd still holds it (a
        graph kept by ``backward(retain_graph=True)``): its device bytes go, its host region
        still has them, and a later backward fetches it again."""
        if entry.state != BACK or self._region_owners.get(entry.key) is not entry:
            return
        entry.device = None
        entry.event = None
        entry.state = ON_HOST
        self.ledger.shrink(entry.bytes)

    def forget(self, entry: SavedTensorState) -> None:
        """Autograd let go of the storage's last view: its device bytes can go."""
        if entry.state == GONE:
            return
        if entry.event is not None and not entry.event.query():
            entry.event.synchronize()  # a copy still reads or writes these bytes
        if entry.state != ON_HOST:
            self.ledger.shrink(entry.bytes)
        entry.device = None
        entry.event = None
        entry.state = GONE
