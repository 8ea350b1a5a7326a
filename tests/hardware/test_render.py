"""The text tree of a topology: structure, bandwidths and GPU details, exactly.

Covers: pipeswap/hardware/render.py.
"""

from __future__ import annotations

from pipeswap.hardware.presets import preset
from pipeswap.hardware.render import render_tree
from pipeswap.hardware.topology import Link, Node, Topology


def test_switch_4_tree_exactly() -> None:
    assert render_tree(preset("switch-4", spec="v100-32gb")) == (
        "switch-4: 4 GPUs, 1 CPU, 2 switches\n"
        "cpu0 (CPU)\n"
        "├── 12.0 GB/s ── sw0 (switch)\n"
        "│   ├── 12.0 GB/s ── gpu0 (GPU: v100-32gb, 32 GiB, 2 copy engines)\n"
        "│   └── 12.0 GB/s ── gpu1 (GPU: v100-32gb, 32 GiB, 2 copy engines)\n"
        "└── 12.0 GB/s ── sw1 (switch)\n"
        "    ├── 12.0 GB/s ── gpu2 (GPU: v100-32gb, 32 GiB, 2 copy engines)\n"
        "    └── 12.0 GB/s ── gpu3 (GPU: v100-32gb, 32 GiB, 2 copy engines)\n"
    )


def test_dual_root_shows_inter_socket_link_between_the_trees() -> None:
    lines = render_tree(preset("dual-root-8", pcie="gen5")).splitlines()
    assert lines[0] == "dual-root-8:gen5: 8 GPUs, 2 CPUs, 4 switches"
    assert lines[1] == "cpu0 (CPU)"
    link_line = lines.index("cpu0 ══ 20.0 GB/s inter-socket ══ cpu1")
    assert lines[link_line + 1] == "cpu1 (CPU)"
    # Four GPUs above the inter-socket line, four below, every PCIe link at 50 GB/s.
    above = [line for line in lines[:link_line] if "gpu" in line]
    below = [line for line in lines[link_line:] if "gpu" in line]
    assert [line.split("── ")[-1].split()[0] for line in above] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert [line.split("── ")[-1].split()[0] for line in below] == ["gpu4", "gpu5", "gpu6", "gpu7"]
    assert sum("50.0 GB/s" in line for line in lines) == 12
    assert len(lines) == 1 + 2 * (1 + 2 + 4) + 1


def test_direct_gpus_duplex_and_single_copy_engine() -> None:
    topology = preset(
        "direct-4", duplex_efficiency=0.5, copy_engines=1, gpu_memory_bytes=11 * 2**30
    )
    assert render_tree(topology).splitlines()[1:3] == [
        "cpu0 (CPU)",
        "├── 12.0 GB/s (duplex 0.5) ── gpu0 (GPU: 11 GiB, 1 copy engine)",
    ]
    assert render_tree(topology).splitlines()[-1] == (
        "└── 12.0 GB/s (duplex 0.5) ── gpu3 (GPU: 11 GiB, 1 copy engine)"
    )


def test_unlimited_memory_cpu_behind_switch_and_stray_nodes() -> None:
    nodes = (
        Node("cpu0", "cpu"),
        Node("cpu1", "cpu"),
        Node("bridge", "switch"),
        Node("gpu0", "gpu", memory_bytes=0),
        Node("lonely", "switch"),
    )
    links = (
        Link("cpu0", "bridge", 16.0),
        Link("bridge", "cpu1", 16.0),
        Link("gpu0", "cpu1", 1.5),
    )
    assert render_tree(Topology("odd", nodes, links)) == (
        "odd: 1 GPU, 2 CPUs, 2 switches\n"
        "cpu0 (CPU)\n"
        "└── 16.0 GB/s ── bridge (switch)\n"
        "    └── 16.0 GB/s ── cpu1 (CPU, tree below)\n"
        "cpu1 (CPU)\n"
        "└── 1.5 GB/s ── gpu0 (GPU: memory unlimited, 2 copy engines)\n"
        "not connected to a CPU:\n"
        "lonely (switch)\n"
    )
