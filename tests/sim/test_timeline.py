"""Tests of the PNG Gantt chart (pipeswap.sim.timeline)."""

import matplotlib.image

from pipeswap.hardware.presets import preset
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.engine import simulate
from pipeswap.sim.timeline import plot_timeline

GB = 10**9


def test_timeline_has_a_row_per_used_stream_and_busy_link(tmp_path) -> None:
    topology = preset("switch-4", gpu_memory_bytes=0)
    b = GraphBuilder()
    f = b.compute("gpu0", 0.5, id="f")
    b.d2h("gpu0", 6 * GB, deps=[f], id="out")
    b.allreduce(["gpu0", "gpu1"], 2 * GB, deps=[f], id="ar")
    b.barrier(["gpu0", "gpu1"], deps=["ar"], id="bar")
    graph = b.build()
    result = simulate(graph, topology, record_rates=True)
    path = tmp_path / "timeline.png"
    rows = plot_timeline(path, graph, result, topology)
    assert rows == [
        "gpu0 compute",
        "gpu0 d2h",
        "gpu0 comm",
        "gpu1 comm",
        "sw0\u2192cpu0",
        "gpu0\u2192sw0",
        "sw0\u2192gpu0",
        "gpu1\u2192sw0",
        "sw0\u2192gpu1",
    ]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[1] > 1000 and image.shape[0] > 300
    # Something other than white was drawn.
    assert (image[..., :3] < 0.9).any()


def test_timeline_without_link_rates_shows_streams_only(tmp_path) -> None:
    topology = preset("direct-4", gpu_memory_bytes=0)
    b = GraphBuilder()
    b.h2d("gpu3", GB, id="in")
    graph = b.build()
    rows = plot_timeline(tmp_path / "t.png", graph, simulate(graph, topology), topology)
    assert rows == ["gpu3 h2d"]
