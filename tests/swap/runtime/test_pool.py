"""HostPool: one allocation, aligned disjoint regions, reusable views.

Covers: pipeswap/swap/runtime/pool.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.swap.runtime.pool import REGION_ALIGNMENT, HostPool


def test_slots_are_disjoint_aligned_views_of_one_buffer() -> None:
    sizes = {("a", 0): 100, ("a", 1): 1024, ("b", 0): 1}
    pool = HostPool(sizes.items())
    assert pool.allocations == 1
    assert len(pool) == 3 and ("a", 1) in pool
    assert pool.region_bytes == 1125
    ranges = []
    for key, nbytes in sizes.items():
        view = pool.region(key)
        assert view.dtype == torch.uint8 and view.numel() == nbytes
        assert view.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
        assert pool.offset(key) % REGION_ALIGNMENT == 0
        ranges.append((pool.offset(key), pool.offset(key) + nbytes))
    ranges.sort()
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    assert pool.capacity_bytes == 512 + 1024 + 512


def test_slots_are_the_same_memory_every_time() -> None:
    pool = HostPool([("x", 64)])
    first = pool.region("x")
    first.fill_(7)
    again = pool.region("x")
    assert again.data_ptr() == first.data_ptr()
    assert int(again.sum()) == 7 * 64


def test_writing_one_slot_leaves_the_others_alone() -> None:
    pool = HostPool([(0, 600), (1, 600)])
    pool.region(0).fill_(1)
    pool.region(1).fill_(2)
    assert int(pool.region(0).sum()) == 600 and int(pool.region(1).sum()) == 1200


def test_cpu_pool_is_not_pinned_and_empty_pool_works() -> None:
    assert not HostPool([("x", 8)]).pinned
    empty = HostPool([], pin=True)
    assert empty.capacity_bytes == 0 and not empty.pinned


def test_bad_slots_are_refused() -> None:
    with pytest.raises(PipeswapError, match="twice"):
        HostPool([("x", 8), ("x", 8)])
    with pytest.raises(PipeswapError, match="no region"):
        HostPool([("x", 8)]).region("y")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_is_pinned_once() -> None:
    pool = HostPool([("x", 1 << 20), ("y", 4096)], pin=True)
    assert pool.pinned and pool.buffer.is_pinned()
    assert pool.region("x").is_pinned()
    assert pool.allocations == 1
