"""The iteration task graph: memory accounting, compute time and swaps, against closed forms.

Covers: pipeswap/swap/workload.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.sim.engine import simulate
from pipeswap.swap.workload import (
    Swap,
    build_iteration_graph,
    gradient_buckets,
    workload_from_profile,
)

GB = 10**9


def test_peak_minimum_and_needs_closed_form(make_profile) -> None:
    # Saved 4, 2, 3 GB; resident = 2 * 3 * 0.01 GB; workspace 1 GB per layer.
    w = workload_from_profile(make_profile([(4,), (2,), (3,)], workspace_bytes=GB))
    resident = 2 * 3 * GB // 100
    assert w.resident_bytes == resident
    assert w.no_swap_peak_bytes() == resident + 9 * GB + GB
    assert w.min_budget_bytes() == resident + 4 * GB + GB
    budget = resident + 7 * GB
    # Forward i holds all saved of layers <= i plus its workspace.
    assert w.needs(budget) == [0, 0, 3 * GB]


def test_no_swap_simulation_matches_compute_and_peak(make_profile) -> None:
    w = workload_from_profile(make_profile([(4,), (2,), (3,)], workspace_bytes=GB))
    graph = build_iteration_graph(w, ["gpu0"], {}, sync_every=3)
    result = simulate(graph, preset("switch-4").with_gpu_memory(0))
    assert result.makespan_s == pytest.approx(3 * 9.0)  # 3 micro-batches of 3 * (1 + 2) s
    assert result.gpus["gpu0"].peak_bytes == w.no_swap_peak_bytes()
    assert result.gpus["gpu0"].stall_s == pytest.approx(0.0)


def test_swapped_tensor_lowers_the_peak_by_its_size(make_profile) -> None:
    w = workload_from_profile(make_profile([(4,), (2,), (3,)]))
    swap = Swap(layer=0, index=0, bytes=4 * GB, out=0, prefetch=1)
    forward, backward = w.memory_points([swap])
    resident = w.resident_bytes
    # Gone from forward 1 on, back from backward 0 on (prefetch issued after backward 1).
    assert forward == [resident + 4 * GB, resident + 2 * GB, resident + 5 * GB]
    assert backward == [resident + 4 * GB, resident + 2 * GB, resident + 5 * GB]
    budget = resident + 5 * GB
    assert not w.fits([swap], budget - 1)
    assert w.fits([swap], budget)
    graph = build_iteration_graph(w, ["gpu0"], {"gpu0": [swap]})
    result = simulate(graph, preset("switch-4").with_gpu_memory(budget))
    assert result.gpus["gpu0"].peak_bytes <= budget
    # The 4 GB swap-out at 12 GB/s takes 1/3 s and forward 1 waits for its memory; the
    # prefetch issued after backward 1 takes 1/3 s more, which backward 0 waits for.
    assert result.makespan_s == pytest.approx(9.0 + 2 / 3)
    assert result.tasks["gpu0/m0/out0.0"].end_s == pytest.approx(1 + 1 / 3)


def test_allreduce_buckets_follow_backward_order(make_profile) -> None:
    w = workload_from_profile(make_profile([(1,)] * 4, param_bytes=10))
    assert gradient_buckets(w, 25) == [(30, 1), (10, 0)]
    graph = build_iteration_graph(w, ["gpu0", "gpu1"], {}, bucket_bytes=25)
    reduces = [t for t in graph.tasks if t.kind == "allreduce"]
    assert [t.bytes for t in reduces] == [30, 10]
    assert set(reduces[0].deps) == {"gpu0/m0/b1", "gpu1/m0/b1"}


def test_profile_without_saved_data_is_refused_with_the_command(make_profile) -> None:
    profile = dataclasses.replace(make_profile([(1,)] * 2), has_saved_data=False)
    with pytest.raises(PipeswapError, match="pipeswap profile --model toy --batch 1 --estimate"):
        workload_from_profile(profile)


def test_each_tensor_is_its_own_copy_in_the_executors_order(make_profile) -> None:
    # Layer 0 saves 4 GB and 2 GB; both go out after forward 0 (ends at 1 s) and copy one
    # after the other at 12 GB/s, index 0 first as the executor issues them. Forward 1
    # needs 2 GB gone: the 4 GB copy frees its memory at 1 1/3 s, without waiting for the
    # 2 GB one (one grouped 6 GB copy would hold everything until 1.5 s).
    w = workload_from_profile(make_profile([(4, 2), (2,), (3,)]))
    budget = w.resident_bytes + 6 * GB
    assert w.needs(budget) == [0, 2 * GB, 5 * GB]
    swaps = [Swap(0, 0, 4 * GB, 0, 1), Swap(0, 1, 2 * GB, 0, 1)]
    assert w.fits(swaps, budget)
    graph = build_iteration_graph(w, ["gpu0"], {"gpu0": swaps})
    result = simulate(graph, preset("switch-4").with_gpu_memory(budget))
    assert result.tasks["gpu0/m0/out0.0"].end_s == pytest.approx(1 + 4 / 12)
    assert result.tasks["gpu0/m0/out0.1"].end_s == pytest.approx(1 + 6 / 12)
    assert result.tasks["gpu0/m0/f1"].start_s == pytest.approx(1 + 4 / 12)
    # The prefetches, issued after backward 1, come back in the same order.
    assert result.tasks["gpu0/m0/in0.0"].start_s < result.tasks["gpu0/m0/in0.1"].start_s
    assert result.gpus["gpu0"].peak_bytes <= budget
