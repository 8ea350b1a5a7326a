"""DeviceMeter: the bytes a device really holds during a step, by a count that is not pipeswap's.

On CUDA it is the caching allocator's own count (``torch.cuda.memory_allocated`` and its
peak). Elsewhere (CPU, and the meta device, where estimates run) it counts every live
storage as torch's ``MemTracker`` does (torch.distributed._tools.mem_tracker): each
storage an operator returns is counted at its ``nbytes`` from the moment it appears until
it is freed (a weak reference says when), plus the storages of what the caller says is
already held (parameters, gradients, optimizer state, the batch). Storages named by
``exclude`` are left out: pipeswap's host pool lives in the same memory on a CPU, but on a
GPU machine it is host memory, so it must not count as the device's.

A swap plan's ledger is a prediction; this meter is the evidence it is checked against.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "CUDA_BLOCK_BYTES",
    "DeviceMeter",
    "MemoryMarks",
    "StorageMeter",
    "held_tensors",
    "host_buffer",
    "unmetered",
]

# The caching allocator hands out blocks in multiples of 512 bytes (c10's kMinBlockSize).
CUDA_BLOCK_BYTES = 512

# Storages of host memory pipeswap keeps swapped tensors in (host pools): no meter counts them.
_HOST: WeakIdKeyDictionary = WeakIdKeyDictionary()


def host_buffer(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor of host memory that no :class:`StorageMeter` counts (a
    host pool's): on a GPU machine it is not the device's, so it never is. Its storage is
    made directly (no operator a meter sees) and known by identity from then on."""
    if pin:  # page-locked, for CUDA, whose meter (its allocator) never counts host memory
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        _HOST[buffer.untyped_storage()] = True
        return buffer
    storage = torch.UntypedStorage(nbytes)
    _HOST[storage] = True
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class _Unmetered:
    depth = 0  # unmetered() regions open now


@contextmanager
def unmetered() -> Iterator[None]:
    """Make storages no :class:`StorageMeter` counts inside: pipeswap's own bookkeeping,
    kept in host memory (an emulator's record of the weights each pass saw, on the CPU),
    not what training holds on the device."""
    _Unmetered.depth += 1
    try:
        yield
    finally:
        _Unmetered.depth -= 1


def held_tensors(*things: Any) -> list[torch.Tensor]:
    """The tensors ``things`` hold: modules' parameters, gradients and buffers, optimizers'
    state, tensors, and nested lists, tuples and dicts of those."""
    found: list[torch.Tensor] = []
    for thing in things:
        if isinstance(thing, nn.Module):
            for p in thing.parameters():
                found.append(p)
                if p.grad is not None:
                    found.append(p.grad)
            found.extend(thing.buffers())
        elif isinstance(thing, torch.optim.Optimizer):
            for state in thing.state.values():
                found.extend(held_tensors(state))
        elif isinstance(thing, torch.Tensor):
            found.append(thing)
        elif isinstance(thing, dict):
            found.extend(held_tensors(*thing.values()))
        elif isinstance(thing, list | tuple):
            found.extend(held_tensors(*thing))
    return found


class _Count:
    """The running total, kept apart from the meter so storages' finalizers hold no meter."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current

    def release(self, nbytes: int) -> None:
        self.current -= nbytes


class StorageMeter(TorchDispatchMode):
    """Live storages of one device type, counted while the mode is on (see the module doc).

    ``with StorageMeter("cpu", holding=(model, optimizer, batch)) as meter: step()`` then
    ``meter.peak``. Storages counted once stay counted until freed, also after the mode is
    left, so one meter can span several steps (``reset_peak`` between them).
    """

    def __init__(
        self,
        device_type: str = "cpu",
        *,
        holding: Iterable[Any] = (),
        exclude: Iterable[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self._count = _Count()
        # False: the mode is on but sees nothing new (a count that ends inside a backward,
        # where the autograd engine would put back a mode taken off there).
        self.seeing = True
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Entry
        self._excluded: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.exclude(*exclude)
        self.hold(*holding)

    @property
    def current(self) -> int:
        return self._count.current

    @property
    def peak(self) -> int:
        return self._count.peak

    def reset_peak(self) -> None:
        self._count.peak = self._count.current

    def hold(self, *things: Any) -> None:
        """Count the storages ``things`` hold now (see :func:`held_tensors`)."""
        for tensor in held_tensors(*things):
            self._see(tensor)

    def exclude(self, *tensors: torch.Tensor) -> None:
        """Never count these tensors' storages (and stop counting them if they were)."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._excluded[storage] = True
            entry = self._sizes.pop(storage, None)
            if entry is not None:
                self._count.release(entry.nbytes)
                entry.nbytes = 0

    def _see(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        if storage in self._excluded or storage in _HOST:
            return
        nbytes = storage.nbytes()
        entry = self._sizes.get(storage)
        if entry is None:
            entry = self._sizes[storage] = _Entry(nbytes)
            self._count.add(nbytes)
            weakref.finalize(storage, _release, self._count, entry)
        elif entry.nbytes != nbytes:  # resized in place
            self._count.add(nbytes - entry.nbytes)
            entry.nbytes = nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if _Unmetered.depth or not self.seeing:
            return out
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._see(leaf)
        return out


class _Entry:
    """The bytes one storage is counted at (0 once excluded)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _release(count: _Count, entry: _Entry) -> None:
    count.release(entry.nbytes)
    entry.nbytes = 0


def _leave(mode: TorchDispatchMode) -> None:
    """Exit ``mode``, also from under plain modes entered after it and still on (another
    offload's count, a user's meter): those are taken off, then put back as they were."""
    stack = _get_current_dispatch_mode_stack()
    if not any(m is mode for m in stack):  # taken off already (a mode exited over it)
        _push_mode(mode)  # so that its exit takes itself off, and puts its flags back
        stack = [*stack, mode]
    above = stack[[id(m) for m in stack].index(id(mode)) + 1 :]
    plain = all(getattr(m, "_mode_key", None) is None for m in above)
    if not plain or any(getattr(m, "_dispatch_key", None) is not None for m in above):
        above = []  # an infrastructure mode (fake tensors, functionalization): as ever
    for _ in above:
        _pop_mode()
    mode.__exit__(None, None, None)
    for other in above:
        _push_mode(other)


class DeviceMeter:
    """The meter of ``device``: CUDA's allocator there, a :class:`StorageMeter` elsewhere.

    ``with DeviceMeter(device, holding=(model, optimizer)) as meter: step()``; then
    ``meter.peak`` is the most the device held inside (CUDA: since the meter was entered
    or last reset) and ``meter.current`` what it holds now. ``holding`` and ``exclude`` are
    for the storage count only: the allocator already knows what it holds, and pipeswap's
    host pool is not in it.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        holding: Iterable[Any] = (),
        exclude: Iterable[torch.Tensor] = (),
    ) -> None:
        self.device = torch.device(device)
        self._on = False
        self._storages = (
            None
            if self.device.type == "cuda"
            else StorageMeter(self.device.type, holding=holding, exclude=exclude)
        )

    @property
    def current(self) -> int:
        if self._storages is None:
            return int(torch.cuda.memory_allocated(self.device))
        return self._storages.current

    @property
    def peak(self) -> int:
        if self._storages is None:
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._storages.peak

    def reset_peak(self) -> None:
        if self._storages is None:
            # The allocator counts on the host as kernels are queued: no synchronize needed.
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._storages.reset_peak()

    def exclude(self, *tensors: torch.Tensor) -> None:
        if self._storages is not None:
            self._storages.exclude(*tensors)

    def hold(self, *things: Any) -> None:
        """Count the storages ``things`` hold from now on (:meth:`StorageMeter.hold`; the
        allocator already knows what it holds)."""
        if self._storages is not None:
            self._storages.hold(*things)

    @property
    def counting(self) -> bool:
        """Whether new storages are seen now (between :meth:`resume` and :meth:`pause`)."""
        return self._on

    def resume(self) -> None:
        """Count again (the storage count only sees what runs while it is on; a CUDA
        allocator always counts)."""
        if self._storages is not None and not self._on:
            self._storages.seeing = True
            self._storages.__enter__()
            self._on = True

    def stop_seeing(self) -> None:
        """See no new storage from now on, the mode left on until :meth:`pause`: inside a
        backward, where the autograd engine puts back, as the backward ends, the modes it
        found (a mode taken off there would stay on for good)."""
        if self._storages is not None:
            self._storages.seeing = False

    def pause(self) -> None:
        """Stop seeing new storages until :meth:`resume` (those counted stay counted until
        freed). Mode stacks are last-in, first-out: resume and pause within one region of
        code (a forward, a backward, an optimizer step). Where the count spans the caller's
        code (offload's, from a forward to the end of its backward), a mode the caller
        entered since and still has on is left on: the count steps out from under it."""
        if self._storages is not None and self._on:
            _leave(self._storages)
            self._on = False

    def __enter__(self) -> DeviceMeter:
        self.reset_peak()
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()

    @property
    def name(self) -> str:
        return "cuda-allocator" if self._storages is None else "storages"


class MemoryMarks:
    """The peak of each named interval of a step, read from ``meter`` at its edges.

    ``close(name)`` ends the interval running since the last edge (or since the marks
    began) and files its peak under ``name`` (the larger, if named twice). ``shift(bytes)``
    notes, from now on, bytes that the step as it is would hold and the device does not
    (a saved storage kept on the host while learning a shape, pipeswap.profiling.on_host):
    every peak is the step's as it is, at every moment of the interval.
    """

    def __init__(self, meter: DeviceMeter) -> None:
        self.meter = meter
        self.start_bytes = meter.current
        self.peaks: dict[str, int] = {}
        self.offset = 0  # bytes the step as it is holds beyond the meter's, now
        self._so_far = 0  # the running interval's peak before the offset last changed
        meter.reset_peak()

    def shift(self, delta: int) -> None:
        self._so_far = max(self._so_far, self.meter.peak + self.offset)
        self.meter.reset_peak()
        self.offset += delta

    def close(self, name: str) -> None:
        peak = max(self._so_far, self.meter.peak + self.offset)
        self.peaks[name] = max(self.peaks.get(name, 0), peak)
        self._so_far = 0
        self.meter.reset_peak()
