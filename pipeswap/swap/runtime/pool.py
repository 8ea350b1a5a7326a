"""HostPool: one host buffer, allocated once (pinned for CUDA), with a fixed region per swapped tensor."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

from pipeswap.errors import PipeswapError
from pipeswap.profiling.meter import host_buffer

__all__ = ["REGION_ALIGNMENT", "HostPool"]

# Regions start on 512-byte boundaries: copy engines move aligned blocks fastest.
REGION_ALIGNMENT = 512


def _align(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class HostPool:
    """Host memory for every tensor a rank swaps, reused by every step.

    ``regions`` gives each swapped tensor (any hashable key, e.g. ``(layer, index)``) its
    size in bytes. The whole pool is one ``uint8`` tensor allocated in the constructor,
    pinned when ``pin`` is true (page-locked memory is what lets a CUDA copy run
    asynchronously on a side stream); a region is a fixed view into it, so no step ever
    allocates host memory, pinned or not. ``allocations`` counts the buffers made (1).
    """

    def __init__(
        self,
        regions: Iterable[tuple[Hashable, int]],
        *,
        pin: bool = False,
        alignment: int = REGION_ALIGNMENT,
    ) -> None:
        offsets: dict[Hashable, tuple[int, int]] = {}
        total = 0
        for key, nbytes in regions:
            if key in offsets:
                raise PipeswapError(f"host pool region {key!r} is listed twice; list each once")
            if nbytes < 0:
                raise PipeswapError(f"host pool region {key!r} has {nbytes} bytes; use 0 or more")
            offsets[key] = (total, nbytes)
            total += _align(nbytes, alignment)
        self.capacity_bytes = total
        self.pinned = bool(pin) and total > 0
        self.allocations = 1
        # [capacity_bytes] uint8: the only host allocation the pool ever makes; host
        # memory, which no device meter counts (pipeswap.profiling.meter).
        self.buffer = host_buffer(total, pin=self.pinned)
        self._views = {
            key: self.buffer.narrow(0, offset, nbytes) for key, (offset, nbytes) in offsets.items()
        }
        self._offsets = offsets

    def __contains__(self, key: Hashable) -> bool:
        return key in self._views

    def __len__(self) -> int:
        return len(self._views)

    @property
    def region_bytes(self) -> int:
        """Bytes the regions use, without alignment padding."""
        return sum(nbytes for _, nbytes in self._offsets.values())

    def offset(self, key: Hashable) -> int:
        return self._offsets[key][0]

    def region(self, key: Hashable, nbytes: int | None = None) -> torch.Tensor:
        """The ``[nbytes]`` uint8 view that holds tensor ``key`` while it is on the host
        (its first ``nbytes`` when given: a smaller tensor of a call the plan covers)."""
        view = self._views.get(key)
        if view is None:
            raise PipeswapError(
                f"the host pool has no region for {key!r}; it holds {len(self)} regions"
            )
        if nbytes is None or nbytes == view.numel():
            return view
        if nbytes > view.numel():
            raise PipeswapError(
                f"tensor {key!r} has {nbytes} bytes but its host region {view.numel()}"
            )
        return view.narrow(0, 0, nbytes)
