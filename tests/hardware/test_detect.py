"""Topology detection: `nvidia-smi` parsing and grouping on canned outputs, NVML with a fake."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from typing import Any

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware import detect
from pipeswap.hardware.detect import (
    DetectedGpu,
    build_topology,
    detect_topology,
    matrix_levels,
    parse_gpu_query,
    parse_topo_matrix,
    pcie_link_gb_per_s,
)
from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import Topology

GIB = 2**30

# A dual-root 8-GPU server (two sockets, two PCIe switches per socket, a NIC under the first
# switch), as nvidia-smi prints it: tab-separated, header underlined with ANSI escapes.
DUAL_ROOT_TOPO = (
    "\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tCPU Affinity\tNUMA Affinity\x1b[0m\n"
    "GPU0\t X \tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tPIX\t0-19,40-59\t0\n"
    "GPU1\tPIX\t X \tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tPIX\t0-19,40-59\t0\n"
    "GPU2\tNODE\tNODE\t X \tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\t0-19,40-59\t0\n"
    "GPU3\tNODE\tNODE\tPIX\t X \tSYS\tSYS\tSYS\tSYS\tNODE\t0-19,40-59\t0\n"
    "GPU4\tSYS\tSYS\tSYS\tSYS\t X \tPIX\tNODE\tNODE\tSYS\t20-39,60-79\t1\n"
    "GPU5\tSYS\tSYS\tSYS\tSYS\tPIX\t X \tNODE\tNODE\tSYS\t20-39,60-79\t1\n"
    "GPU6\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\t X \tPIX\tSYS\t20-39,60-79\t1\n"
    "GPU7\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\t X \tSYS\t20-39,60-79\t1\n"
    "NIC0\tPIX\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \t\t\t\t\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes "
    "(e.g., QPI/UPI)\n"
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges "
    "within a NUMA node\n"
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
    "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host "
    "Bridge)\n"
    "  PIX  = Connection traversing at most a single PCIe bridge\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\n"
    "NIC Legend:\n"
    "\n"
    "  NIC0: mlx5_0\n"
)

DUAL_ROOT_QUERY = """\
0, Tesla V100-PCIE-32GB, 32768, 3, 16
1, Tesla V100-PCIE-32GB, 32768, 3, 16
2, Tesla V100-PCIE-32GB, 32768, 3, 16
3, Tesla V100-PCIE-32GB, 32768, 3, 16
5, Tesla V100-PCIE-32GB, 32768, 3, 16
4, Tesla V100-PCIE-32GB, 32768, 3, 16
6, Tesla V100-PCIE-32GB, 32768, 3, 16
7, Tesla V100-PCIE-32GB, 32768, 3, 16
"""

# A 4-GPU workstation: one socket, two switches on one host bridge; newer drivers add the
# "GPU NUMA ID" column. Copied from a terminal, so aligned with spaces instead of tabs.
SWITCH_4_TOPO = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      PIX     PHB     PHB     0-31            0               N/A
GPU1    PIX      X      PHB     PHB     0-31            0               N/A
GPU2    PHB     PHB      X      PIX     0-31            0               N/A
GPU3    PHB     PHB     PIX      X      0-31            0               N/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

SWITCH_4_QUERY = """\
0, NVIDIA GeForce RTX 3090, 24576, 4, 16
1, NVIDIA GeForce RTX 3090, 24576, 4, 16
2, NVIDIA GeForce RTX 3090, 24576, 4, 16
3, NVIDIA GeForce RTX 3090, 24576, 4, 8
"""

# NVLink everywhere (an SXM board): the matrix hides the PCIe relation behind NV#.
NVLINK_TOPO = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV12    NV12    NV12    0-23            0
GPU1    NV12     X      NV12    NV12    0-23            0
GPU2    NV12    NV12     X      NV12    24-47           1
GPU3    NV12    NV12    NV12     X      24-47           1
"""


def _structure(topology: Topology) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Nodes and links regardless of their order in the tuples."""
    nodes = sorted((n.id, n.kind, n.copy_engines, n.memory_bytes) for n in topology.nodes)
    links = sorted(
        (tuple(sorted((link.a, link.b))), link.gb_per_s, link.duplex_efficiency, link.kind)
        for link in topology.links
    )
    return nodes, links


# ---- pure parsing -------------------------------------------------------------------------
def test_parse_dual_root_matrix() -> None:
    matrix = parse_topo_matrix(DUAL_ROOT_TOPO)
    assert matrix.gpus == tuple(f"GPU{i}" for i in range(8))
    assert matrix.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    assert matrix.codes[0] == ("X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS")
    assert matrix.codes[7][6] == "PIX"
    levels = matrix_levels(matrix)
    assert levels[0] == [0, 10, 40, 40, 50, 50, 50, 50]
    assert all(levels[i][j] == levels[j][i] for i in range(8) for j in range(8))


def test_parse_space_aligned_matrix_with_gpu_numa_id() -> None:
    matrix = parse_topo_matrix(SWITCH_4_TOPO)
    assert matrix.gpus == ("GPU0", "GPU1", "GPU2", "GPU3")
    assert matrix.numa == (0, 0, 0, 0)
    assert matrix_levels(matrix)[1] == [10, 0, 30, 30]


def test_nvlink_pairs_fall_back_to_numa_nodes() -> None:
    levels = matrix_levels(parse_topo_matrix(NVLINK_TOPO))
    assert levels[0] == [0, 40, 50, 50]
    assert levels[3] == [50, 50, 40, 0]


def test_bad_matrices_are_refused() -> None:
    with pytest.raises(PipeswapError, match="no header row"):
        parse_topo_matrix("No devices were found\n")
    with pytest.raises(PipeswapError, match="unknown code 'QQQ' between GPU0 and GPU1"):
        matrix_levels(parse_topo_matrix(SWITCH_4_TOPO.replace("PIX", "QQQ", 1)))
    truncated = "\n".join(SWITCH_4_TOPO.splitlines()[:3])
    with pytest.raises(PipeswapError, match="no row for GPU2, GPU3"):
        parse_topo_matrix(truncated)


def test_parse_gpu_query_sorts_by_index_and_converts_mib() -> None:
    gpus = parse_gpu_query(DUAL_ROOT_QUERY)
    assert len(gpus) == 8
    assert gpus[0] == DetectedGpu("Tesla V100-PCIE-32GB", 32 * GIB, 3, 16)
    assert parse_gpu_query(SWITCH_4_QUERY)[3].pcie_width == 8
    with pytest.raises(PipeswapError, match="cannot read line"):
        parse_gpu_query("0, A100, [N/A], 4, 16\n")
    with pytest.raises(PipeswapError, match="cannot read line"):
        parse_gpu_query("0, A100\n")


def test_link_bandwidth_is_per_lane_times_width() -> None:
    assert pcie_link_gb_per_s(3, 16) == 12.0
    assert pcie_link_gb_per_s(4, 16) == 25.0
    assert pcie_link_gb_per_s(4, 8) == 12.5
    assert pcie_link_gb_per_s(5, 16) == 50.0
    assert pcie_link_gb_per_s(3, 1) == 0.75
    assert pcie_link_gb_per_s(1, 16) == 3.0
    assert pcie_link_gb_per_s(7, 16) == pcie_link_gb_per_s(6, 16) == 100.0
    with pytest.raises(PipeswapError, match="not a working link"):
        pcie_link_gb_per_s(0, 16)


# ---- grouping -----------------------------------------------------------------------------
def test_dual_root_canned_output_gives_the_dual_root_preset() -> None:
    levels = matrix_levels(parse_topo_matrix(DUAL_ROOT_TOPO))
    topology = build_topology(levels, parse_gpu_query(DUAL_ROOT_QUERY))
    assert topology.name == "detected"
    assert topology.gpus == [f"gpu{i}" for i in range(8)]
    assert _structure(topology) == _structure(preset("dual-root-8"))


def test_switch_4_canned_output_gives_the_switch_4_preset_with_one_narrow_gpu() -> None:
    levels = matrix_levels(parse_topo_matrix(SWITCH_4_TOPO))
    topology = build_topology(levels, parse_gpu_query(SWITCH_4_QUERY), copy_engines=1)
    expected = preset("switch-4", pcie="gen4", gpu_memory_bytes=24 * GIB, copy_engines=1)
    nodes, links = _structure(topology)
    expected_nodes, expected_links = _structure(expected)
    assert nodes == expected_nodes
    # gpu3 trains at x8: half its x16 bandwidth; its switch's uplink keeps the fastest.
    narrow = [link for link in links if link[0] == ("gpu3", "sw1")]
    assert narrow == [(("gpu3", "sw1"), 12.5, 1.0, "pcie")]
    assert [link for link in links if link[0] != ("gpu3", "sw1")] == [
        link for link in expected_links if link[0] != ("gpu3", "sw1")
    ]


def test_nested_switches_from_pxb_and_lone_gpus() -> None:
    # Socket 0: GPUs 0-1 and 2-3 behind two leaf switches under one top switch (PXB), GPU 4
    # under that top switch alone; socket 0 also has GPU 5 on its own root port.
    #          0   1   2   3   4   5
    levels = [
        [0, 10, 20, 20, 20, 40],
        [10, 0, 20, 20, 20, 40],
        [20, 20, 0, 10, 20, 40],
        [20, 20, 10, 0, 20, 40],
        [20, 20, 20, 20, 0, 40],
        [40, 40, 40, 40, 40, 0],
    ]
    gpus = [DetectedGpu("a100", 80 * GIB, 4, 16)] * 6
    topology = build_topology(levels, gpus)
    assert topology.cpus == ["cpu0"]
    assert _structure(topology)[1] == sorted(
        [
            (("cpu0", "sw0"), 25.0, 1.0, "pcie"),
            (("sw0", "sw1"), 25.0, 1.0, "pcie"),
            (("gpu0", "sw1"), 25.0, 1.0, "pcie"),
            (("gpu1", "sw1"), 25.0, 1.0, "pcie"),
            (("sw0", "sw2"), 25.0, 1.0, "pcie"),
            (("gpu2", "sw2"), 25.0, 1.0, "pcie"),
            (("gpu3", "sw2"), 25.0, 1.0, "pcie"),
            (("gpu4", "sw0"), 25.0, 1.0, "pcie"),
            (("cpu0", "gpu5"), 25.0, 1.0, "pcie"),
        ]
    )


def test_nvlink_board_gives_two_sockets_of_direct_gpus() -> None:
    levels = matrix_levels(parse_topo_matrix(NVLINK_TOPO))
    topology = build_topology(levels, [DetectedGpu("h100", 80 * GIB, 5, 16)] * 4)
    assert [topology.host_of(g) for g in topology.gpus] == ["cpu0", "cpu0", "cpu1", "cpu1"]
    assert [len(topology.path(g, topology.host_of(g))) for g in topology.gpus] == [1, 1, 1, 1]
    assert [link.kind for link in topology.links].count("inter-socket") == 1


def test_matrix_size_must_match_gpu_count() -> None:
    with pytest.raises(PipeswapError, match="need a 2x2 matrix"):
        build_topology([[0]], [DetectedGpu("x", 1, 3, 16)] * 2)


# ---- detect_topology with fake drivers ----------------------------------------------------
class _FakeNvmlError(Exception):
    pass


def _fake_pynvml(levels: list[list[int]], gpus: list[DetectedGpu]) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = _FakeNvmlError  # type: ignore[attr-defined]
    calls: list[str] = []

    def no_max(handle: int) -> int:
        raise _FakeNvmlError("not supported")

    functions = {
        "nvmlInit": lambda: calls.append("init"),
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: gpus[h].name.encode(),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(total=gpus[h].memory_bytes),
        # Generation: the maximum is not supported, so the current one is used.
        "nvmlDeviceGetMaxPcieLinkGeneration": no_max,
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: gpus[h].pcie_generation,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: gpus[h].pcie_width,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 1,
        "nvmlDeviceGetTopologyCommonAncestor": lambda a, b: levels[a][b],
    }
    for name, function in functions.items():
        setattr(module, name, function)
    module.calls = calls  # type: ignore[attr-defined]
    return module


def test_detect_with_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    levels = matrix_levels(parse_topo_matrix(DUAL_ROOT_TOPO))
    fake = _fake_pynvml(levels, parse_gpu_query(DUAL_ROOT_QUERY))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    topology = detect_topology(copy_engines=1)
    assert topology is not None
    assert _structure(topology) == _structure(preset("dual-root-8", copy_engines=1))
    assert fake.calls == ["init", "shutdown"]  # type: ignore[attr-defined]


def test_detect_with_nvidia_smi_when_nvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    commands: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        output = SWITCH_4_TOPO if command[1:] == ["topo", "-m"] else SWITCH_4_QUERY
        return subprocess.CompletedProcess(command, 0, stdout=output, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    topology = detect_topology()
    assert topology is not None
    assert topology.gpus == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert {topology.node(g).memory_bytes for g in topology.gpus} == {24 * GIB}
    assert len(commands) == 2
    assert commands[0][1].startswith("--query-gpu=index,name,memory.total,pcie.link.gen.max")


def test_detect_without_gpus_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert detect_topology() is None

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def failing_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.CalledProcessError(9, command, "No devices were found")

    monkeypatch.setattr(subprocess, "run", failing_run)
    assert detect_topology() is None


def test_nvml_without_driver_falls_through(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml([], [])

    def no_driver() -> None:
        raise _FakeNvmlError("driver not loaded")

    fake.nvmlInit = no_driver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert detect._query_nvml() is None
    assert detect_topology() is None


@pytest.mark.cuda
def test_detect_on_this_machine() -> None:
    found = detect._query_nvml() or detect._query_nvidia_smi()
    if found is None:
        pytest.skip("no NVIDIA GPU here")
    topology = detect_topology()
    assert topology is not None
    assert len(topology.gpus) == len(found[0])
    for gpu in topology.gpus:
        assert topology.node(gpu).memory_bytes > 2**30
        host = topology.host_of(gpu)
        assert all(topology.links[i].gb_per_s >= 0.75 for i, _ in topology.path(gpu, host))
    assert Topology.from_json(topology.to_json()) == topology


def test_a_gpu_s_memory_is_what_torch_can_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi's total (an H200: 150754820096 bytes) is more than torch's (150109880320):
    a budget of the whole GPU must be one torch accepts, so the topology takes torch's."""
    import torch

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        output = SWITCH_4_TOPO if command[1:] == ["topo", "-m"] else SWITCH_4_QUERY
        return subprocess.CompletedProcess(command, 0, stdout=output, stderr="")

    class Properties:
        total_memory = 24 * GIB - 644939776

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    topology = detect_topology()
    assert topology is not None
    assert {topology.node(g).memory_bytes for g in topology.gpus} == {24 * GIB - 644939776}
