"""The iteration task graph: compute, swaps, recompute, buckets and steps, against closed forms.

Covers: pipeswap/swap/plan/iteration.py.
"""

from __future__ import annotations

import pytest
from support import toy_layer, toy_profile_of

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import Link, Node, Topology
from pipeswap.sim.collectives import ring_allreduce_time_s
from pipeswap.sim.engine import simulate
from pipeswap.swap.plan.iteration import build_iteration_graph, gradient_buckets
from pipeswap.swap.plan.tensors import SwapDecisionAt
from pipeswap.swap.plan.workload import Workload, workload_from_profile
from pipeswap.swap.swap_config import SwapConfig

GB = 10**9


def test_no_swap_simulation_matches_compute_and_peak(make_profile) -> None:
    w = workload_from_profile(make_profile([(4,), (2,), (3,)], workspace_bytes=GB))
    graph = build_iteration_graph(w, ["gpu0"], {}, sync_every=3)
    result = simulate(graph, preset("switch-4").with_gpu_memory(0))
    assert result.makespan_s == pytest.approx(3 * 9.0)  # 3 micro-batches of 3 * (1 + 2) s
    assert result.gpus["gpu0"].peak_bytes == w.no_swap_peak_bytes()
    assert result.gpus["gpu0"].stall_s == pytest.approx(0.0)


def test_allreduce_buckets_follow_backward_order(make_profile) -> None:
    w = workload_from_profile(make_profile([(1,)] * 4, param_bytes=10))
    assert gradient_buckets(w, 25) == [(30, 1), (10, 0)]
    graph = build_iteration_graph(w, ["gpu0", "gpu1"], {}, bucket_bytes=25)
    reduces = [t for t in graph.tasks if t.kind == "allreduce"]
    assert [t.bytes for t in reduces] == [30, 10]
    assert set(reduces[0].deps) == {"gpu0/m0/b1", "gpu1/m0/b1"}


def test_each_tensor_is_its_own_copy_in_the_executors_order(make_profile) -> None:
    # Layer 0 saves 4 GB and 2 GB; both go out after forward 0 (ends at 1 s) and copy one
    # after the other at 12 GB/s, index 0 first as the executor issues them. Forward 1
    # needs 2 GB gone: the 4 GB copy frees its memory at 1 1/3 s, without waiting for the
    # 2 GB one (one grouped 6 GB copy would hold everything until 1.5 s).
    w = workload_from_profile(make_profile([(4, 2), (2,), (3,)]))
    budget = w.resident_bytes + 6 * GB
    assert w.needs(budget) == [0, 2 * GB, 5 * GB]
    swaps = [SwapDecisionAt(0, 0, 4 * GB, 0, 1), SwapDecisionAt(0, 1, 2 * GB, 0, 1)]
    assert w.fits(swaps, budget)
    graph = build_iteration_graph(w, ["gpu0"], {"gpu0": swaps})
    result = simulate(graph, preset("switch-4").with_gpu_memory(budget))
    assert result.tasks["gpu0/m0/out0.0"].end_s == pytest.approx(1 + 4 / 12)
    assert result.tasks["gpu0/m0/out0.1"].end_s == pytest.approx(1 + 6 / 12)
    assert result.tasks["gpu0/m0/f1"].start_s == pytest.approx(1 + 4 / 12)
    # The prefetches, issued after backward 1, come back in the same order.
    assert result.tasks["gpu0/m0/in0.0"].start_s < result.tasks["gpu0/m0/in0.1"].start_s
    assert result.gpus["gpu0"].peak_bytes <= budget


# ---- several iterations, DDP buckets and closed forms (the data-parallel baseline) -------
def _one_switch(gpus: int = 4, gb_per_s: float = 10.0) -> Topology:
    # One switch: every ring hop has its own link direction, so the closed form holds.
    nodes = [Node("cpu0", "cpu"), Node("sw0", "switch")]
    nodes += [Node(f"gpu{i}", "gpu", memory_bytes=0) for i in range(gpus)]
    links = [Link(f"gpu{i}", "sw0", gb_per_s) for i in range(gpus)]
    return Topology("one-switch", tuple(nodes), tuple([*links, Link("sw0", "cpu0", gb_per_s)]))


def _dp_workload(
    params: list[int], forward: float = 1.0, backward: float = 2.0, update_s: float = 0.0
) -> Workload:
    # SGD with momentum: resident = weights, gradients and momentum = 3 * sum(params).
    profile = toy_profile_of(
        (
            toy_layer(f"l{i}", forward, backward, param_bytes=p, saved=[100 * (i + 1)])
            for i, p in enumerate(params)
        ),
        batch=8,
        device="cpu",
        optimizer_state_bytes=sum(params),
    )
    return workload_from_profile(profile, optimizer_step_s=update_s)


def test_buckets_fill_in_backward_order_and_skip_parameterless_layers() -> None:
    w = _dp_workload([30, 0, 10, 20, 5])
    assert gradient_buckets(w, 25) == [(25, 3), (40, 0)]
    assert gradient_buckets(w, None) == [(65, 0)]
    assert gradient_buckets(w, 1) == [(5, 4), (20, 3), (10, 2), (30, 0)]
    # A bucket is complete after the backward of its lowest layer with parameters.
    assert gradient_buckets(_dp_workload([0, 10, 5]), None) == [(15, 1)]
    assert gradient_buckets(_dp_workload([0, 0]), None) == []
    # The size is checked once, by SwapConfig (a bucket of 0 bytes cannot be asked for).
    with pytest.raises(PipeswapError, match="bucket_bytes is 0 bytes; use a positive size"):
        SwapConfig(bucket_bytes=0)


def test_one_bucket_iteration_is_compute_plus_ring_allreduce() -> None:
    n, topology = 4, _one_switch(4)
    w = _dp_workload([GB, GB], update_s=0.5)
    result = simulate(build_iteration_graph(w, topology.gpus, bucket_bytes=None), topology)
    ring = ring_allreduce_time_s(2 * GB, n, 10e9)
    assert ring == pytest.approx(0.3)
    assert result.makespan_s == pytest.approx(2 * 1.0 + 2 * 2.0 + ring + 0.5)
    # Steps repeat exactly: the second costs as much as the first.
    two = simulate(build_iteration_graph(w, topology.gpus, bucket_bytes=None, steps=2), topology)
    assert two.makespan_s == pytest.approx(2 * result.makespan_s)
    assert two.tasks["gpu0/s1/m0/f0"].start_s == pytest.approx(result.makespan_s)


def test_buckets_overlap_the_rest_of_backward() -> None:
    n, topology = 4, _one_switch(4)
    # Last layer's bucket (4 GB: 1.2 s) hides under layer 0's 2 s backward; only
    # layer 0's bucket (1 GB: 0.3 s) remains exposed.
    w = _dp_workload([GB, 4 * GB])
    result = simulate(build_iteration_graph(w, topology.gpus, bucket_bytes=GB), topology)
    exposed = ring_allreduce_time_s(GB, n, 10e9)
    assert result.makespan_s == pytest.approx(2 * 1.0 + 2 * 2.0 + exposed)
    hidden = result.tasks["allreduce0"]
    assert hidden.end_s - hidden.start_s == pytest.approx(ring_allreduce_time_s(4 * GB, n, 10e9))
    assert hidden.end_s < result.tasks["gpu0/m0/b0"].end_s


def test_allreduce_bytes_sum_to_all_gradients_and_memory_peaks_at_the_turn() -> None:
    topology = _one_switch(2)
    w = _dp_workload([GB, 0, 3 * GB])
    graph = build_iteration_graph(w, topology.gpus, bucket_bytes=2 * GB, steps=3)
    reduces = [t for t in graph.tasks if t.kind == "allreduce"]
    assert len(reduces) == 3 * 2
    assert sum(t.bytes for t in reduces) == 3 * 4 * GB
    assert all(t.gpus == ("gpu0", "gpu1") for t in reduces)
    # Resident state is taken once and given back after the last step only.
    steps = [t for t in graph.tasks if t.id.startswith("gpu0/") and t.id.endswith("step")]
    assert [t.free_bytes for t in steps] == [0, 0, w.resident_bytes]
    result = simulate(build_iteration_graph(w, topology.gpus, bucket_bytes=2 * GB), topology)
    for gpu in ("gpu0", "gpu1"):
        # Weights, gradients, momentum, and every layer's saved tensors at once.
        assert result.gpus[gpu].peak_bytes == 3 * 4 * GB + 100 + 200 + 300


def test_a_model_too_large_for_the_gpu_cannot_run() -> None:
    from pipeswap.sim.engine import OutOfMemoryError

    topology = preset("switch-4", gpu_memory_bytes=10 * GB)
    with pytest.raises(OutOfMemoryError):
        simulate(build_iteration_graph(_dp_workload([2 * GB, 2 * GB]), topology.gpus), topology)


def test_shared_switch_uplinks_carry_one_ring_flow_each_way() -> None:
    # switch-4: the ring crosses each switch uplink once per direction, so every hop still
    # gets a full link and the closed form holds on the real preset.
    topology = preset("switch-4", gpu_memory_bytes=0)
    graph = build_iteration_graph(_dp_workload([GB]), topology.gpus, bucket_bytes=None)
    result = simulate(graph, topology)
    assert result.makespan_s == pytest.approx(3.0 + ring_allreduce_time_s(GB, 4, 12e9))


def test_one_gpu_has_no_allreduce_and_bad_arguments_are_refused() -> None:
    w = _dp_workload([GB])
    assert not [t for t in build_iteration_graph(w, ["gpu0"]).tasks if t.kind == "allreduce"]
    with pytest.raises(PipeswapError, match="steps"):
        build_iteration_graph(w, ["gpu0"], steps=0)
    # The simulator refuses a GPU the topology does not have, naming it.
    with pytest.raises(PipeswapError, match="gpu9"):
        simulate(build_iteration_graph(w, ["gpu0", "gpu9"]), _one_switch(2))


# ---- recomputation -------------------------------------------------------------------------
def _recompute_profile(make_profile):
    # Saved 4, 2 and (3 + 1) GB; every output 1 GB (the working set of each layer, and what
    # a recomputed layer keeps); layer 2 saves its 1 GB input among its tensors.
    return make_profile([(4,), (2,), (3, 1)], output_gb=1)


def test_recompute_tasks_in_the_graph_and_their_simulation(make_profile) -> None:
    w = workload_from_profile(_recompute_profile(make_profile))
    graph = build_iteration_graph(w, ["gpu0"], recompute={"gpu0": {1, 2}})
    tasks = {t.id: t for t in graph.tasks}
    rerun = tasks["gpu0/m0/r2"]
    assert rerun.kind == "compute" and rerun.duration_s == 1.0
    assert rerun.alloc_bytes == 3 * GB + GB and rerun.free_bytes == GB
    assert tasks["gpu0/m0/b2"].deps[0] == "gpu0/m0/r2"
    assert tasks["gpu0/m0/b2"].free_bytes == GB + GB + 3 * GB  # working set, input, re-run
    assert "gpu0/m0/r0" not in tasks
    result = simulate(graph, preset("switch-4").with_gpu_memory(0))
    assert result.makespan_s == pytest.approx(3 * 3.0 + 2 * 1.0)
    assert result.gpus["gpu0"].peak_bytes == w.recomputing({1, 2}).no_swap_peak_bytes()
    order = sorted((v.start_s, k) for k, v in result.tasks.items() if "/m0/" in k)
    assert [k.split("/")[-1] for _, k in order][3:] == ["r2", "b2", "r1", "b1", "b0"]
