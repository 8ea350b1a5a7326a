"""Tests of the ring allreduce decomposition (pipeswap.sim.collectives).

Covers: pipeswap/sim/collectives.py.
"""

import pytest

from pipeswap.sim.collectives import (
    ring_allreduce_chunk_bytes,
    ring_allreduce_sends,
    ring_allreduce_steps,
    ring_allreduce_time_s,
)


def test_ring_follows_list_order_and_wraps() -> None:
    gpus = ["gpu2", "gpu0", "gpu1"]
    assert ring_allreduce_sends(gpus) == [("gpu2", "gpu0"), ("gpu0", "gpu1"), ("gpu1", "gpu2")]
    assert ring_allreduce_steps(gpus) == 4
    assert ring_allreduce_chunk_bytes(9, gpus) == 3.0
    assert ring_allreduce_sends(["gpu0"]) == [] and ring_allreduce_steps(["gpu0"]) == 0


def test_total_bytes_per_gpu_is_two_n_minus_one_over_n_of_the_buffer() -> None:
    gpus = [f"gpu{i}" for i in range(8)]
    sent = ring_allreduce_steps(gpus) * ring_allreduce_chunk_bytes(8 * 10**9, gpus)
    assert sent == 2 * 7 / 8 * 8 * 10**9
    assert ring_allreduce_time_s(8 * 10**9, 8, 1e9) == pytest.approx(14.0)
    assert ring_allreduce_time_s(10, 1, 1e9) == 0.0
