"""Tests of which streams a task occupies (pipeswap.sim.task_streams)."""

from dataclasses import replace

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import Link, Node, Topology
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import Task, TaskGraph
from pipeswap.sim.task_streams import gpu_streams, task_streams


def test_copy_engines_decide_the_copy_streams() -> None:
    two, one = preset("switch-4"), preset("switch-4", copy_engines=1)
    d2h = Task("o", "d2h", gpu="gpu1", bytes=1)
    h2d = Task("i", "h2d", gpu="gpu1", bytes=1)
    assert task_streams(d2h, two) == [("gpu1", "d2h")]
    assert task_streams(h2d, two) == [("gpu1", "h2d")]
    assert task_streams(d2h, one) == task_streams(h2d, one) == [("gpu1", "copy")]
    assert gpu_streams(two, "gpu0") == ("compute", "h2d", "d2h", "comm")
    assert gpu_streams(one, "gpu0") == ("compute", "copy", "comm")


def test_communication_occupies_every_participant() -> None:
    topo = preset("switch-4")
    assert task_streams(Task("c", "compute", gpu="gpu2", duration_s=1), topo) == [
        ("gpu2", "compute")
    ]
    assert task_streams(Task("s", "p2p", src="gpu0", dst="gpu3", bytes=1), topo) == [
        ("gpu0", "comm"),
        ("gpu3", "comm"),
    ]
    assert task_streams(Task("a", "allreduce", gpus=("gpu1", "gpu2"), bytes=1), topo) == [
        ("gpu1", "comm"),
        ("gpu2", "comm"),
    ]


def test_a_cpu_rank_copies_out_with_the_thread_that_computes() -> None:
    cpu = Topology(
        "cpu-ranks",
        (Node("cpu0", "cpu"), Node("gpu0", "gpu", memory_bytes=0, spec="cpu")),
        (Link("gpu0", "cpu0", 1.0),),
    )
    d2h = Task("o", "d2h", gpu="gpu0", bytes=1)
    assert task_streams(d2h, cpu) == [("gpu0", "compute"), ("gpu0", "d2h")]
    assert task_streams(Task("i", "h2d", gpu="gpu0", bytes=1), cpu) == [("gpu0", "h2d")]
    # Compute, copy out 1 GB at 1 GB/s, compute: on a CPU rank the copy delays the second
    # computation; a GPU's copy engine overlaps it.
    graph = TaskGraph(
        (
            Task("f0", "compute", gpu="gpu0", duration_s=1.0),
            Task("out", "d2h", gpu="gpu0", bytes=10**9, deps=("f0",)),
            Task("f1", "compute", gpu="gpu0", duration_s=1.0, deps=("f0",)),
        )
    )
    assert simulate(graph, cpu).makespan_s == pytest.approx(3.0)
    gpu = replace(cpu, nodes=(cpu.nodes[0], replace(cpu.nodes[1], spec=None)))
    assert simulate(graph, gpu).makespan_s == pytest.approx(2.0)
