"""Data-parallel task graphs: simulated iteration times and memory match closed forms.

Covers: pipeswap/pipeline/dp_graph.py.
"""

from __future__ import annotations

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import Link, Node, Topology
from pipeswap.pipeline.dp_graph import (
    data_parallel_graph,
    data_parallel_task_graph,
    gradient_buckets,
)
from pipeswap.profile import LayerProfile, Profile, SavedTensor
from pipeswap.sim.collectives import ring_allreduce_time_s
from pipeswap.sim.engine import simulate

GB = 10**9


def _topology(gpus: int = 4, gb_per_s: float = 10.0) -> Topology:
    # One switch: every ring hop has its own link direction, so the closed form holds.
    nodes = [Node("cpu0", "cpu"), Node("sw0", "switch")]
    nodes += [Node(f"gpu{i}", "gpu", memory_bytes=0) for i in range(gpus)]
    links = [Link(f"gpu{i}", "sw0", gb_per_s) for i in range(gpus)]
    return Topology("one-switch", tuple(nodes), tuple([*links, Link("sw0", "cpu0", gb_per_s)]))


def _profile(params: list[int], forward: float = 1.0, backward: float = 2.0) -> Profile:
    return Profile(
        "toy", 8, "float32", "estimate", "cpu", "sgd", sum(params),
        tuple(
            LayerProfile(f"l{i}", forward, backward, p, 0, (SavedTensor(0, 100 * (i + 1)),))
            for i, p in enumerate(params)
        ),
    )  # fmt: skip


def test_buckets_fill_in_backward_order_and_skip_parameterless_layers() -> None:
    profile = _profile([30, 0, 10, 20, 5])
    assert gradient_buckets(profile, 25) == [(4, 3), (2, 0)]
    assert gradient_buckets(profile, None) == [(4, 3, 2, 0)]
    assert gradient_buckets(profile, 1) == [(4,), (3,), (2,), (0,)]
    with pytest.raises(PipeswapError, match="bucket_bytes"):
        gradient_buckets(profile, 0)


def test_one_bucket_iteration_is_compute_plus_ring_allreduce() -> None:
    n, topology = 4, _topology(4)
    profile = _profile([GB, GB])
    graph = data_parallel_graph(profile, topology, steps=1, bucket_bytes=None, update_s=0.5)
    result = simulate(graph, topology)
    ring = ring_allreduce_time_s(2 * GB, n, 10e9)
    assert ring == pytest.approx(0.3)
    assert result.makespan_s == pytest.approx(2 * 1.0 + 2 * 2.0 + ring + 0.5)
    # Steps repeat exactly: the second costs as much as the first.
    two = simulate(data_parallel_graph(profile, topology, steps=2, bucket_bytes=None,
                                       update_s=0.5), topology)  # fmt: skip
    assert two.makespan_s == pytest.approx(2 * result.makespan_s)


def test_buckets_overlap_the_rest_of_backward() -> None:
    n, topology = 4, _topology(4)
    # Last layer's bucket (4 GB: 1.2 s) hides under layer 0's 2 s backward; only
    # layer 0's bucket (1 GB: 0.3 s) remains exposed.
    profile = _profile([GB, 4 * GB])
    graph = data_parallel_graph(profile, topology, bucket_bytes=GB)
    result = simulate(graph, topology)
    exposed = ring_allreduce_time_s(GB, n, 10e9)
    assert result.makespan_s == pytest.approx(2 * 1.0 + 2 * 2.0 + exposed)
    hidden = result.tasks["AR0.0"]
    assert hidden.end_s - hidden.start_s == pytest.approx(ring_allreduce_time_s(4 * GB, n, 10e9))
    assert hidden.end_s < result.tasks["gpu0:B0.0"].end_s


def test_allreduce_bytes_sum_to_all_gradients_and_memory_peaks_at_the_turn() -> None:
    topology = _topology(2)
    profile = _profile([GB, 0, 3 * GB])
    obj = data_parallel_task_graph(profile, topology, steps=3, bucket_bytes=2 * GB)
    reduces = [t for t in obj["tasks"] if t["kind"] == "allreduce"]
    assert len(reduces) == 3 * 2
    assert sum(t["bytes"] for t in reduces) == 3 * 4 * GB
    assert all(t["gpus"] == ["gpu0", "gpu1"] for t in reduces)
    result = simulate(data_parallel_graph(profile, topology, bucket_bytes=2 * GB), topology)
    for gpu in ("gpu0", "gpu1"):
        # Weights, gradients, momentum, and every layer's saved tensors at once.
        assert result.gpus[gpu].peak_bytes == 3 * 4 * GB + 100 + 200 + 300


def test_a_model_too_large_for_the_gpu_cannot_run() -> None:
    from pipeswap.sim.engine import OutOfMemoryError

    topology = preset("switch-4", gpu_memory_bytes=10 * GB)
    with pytest.raises(OutOfMemoryError):
        simulate(data_parallel_graph(_profile([2 * GB, 2 * GB]), topology), topology)


def test_shared_switch_uplinks_carry_one_ring_flow_each_way() -> None:
    # switch-4: the ring crosses each switch uplink once per direction, so every hop still
    # gets a full link and the closed form holds on the real preset.
    topology = preset("switch-4", gpu_memory_bytes=0)
    profile = _profile([GB])
    result = simulate(data_parallel_graph(profile, topology, bucket_bytes=None), topology)
    assert result.makespan_s == pytest.approx(3.0 + ring_allreduce_time_s(GB, 4, 12e9))


def test_unknown_gpu_is_refused() -> None:
    with pytest.raises(PipeswapError, match="gpu9"):
        data_parallel_task_graph(_profile([1]), _topology(2), gpus=["gpu0", "gpu9"])
