"""Build the Topology of this machine's NVIDIA GPUs from NVML, or from `nvidia-smi topo -m`."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipeswap.config_fields import ConfigError, require
from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import (
    INTER_SOCKET_GB_PER_S,
    INTER_SOCKET_KIND,
    PCIE_GB_PER_S,
    resolve_topology,
)
from pipeswap.hardware.topology import Link, Node, Topology
from pipeswap.hardware.unionfind import UnionFind

__all__ = [
    "LEVEL_HOST_BRIDGE",
    "LEVEL_NUMA_NODE",
    "LEVEL_SWITCH",
    "LEVEL_SWITCHES",
    "LEVEL_SYSTEM",
    "DetectedGpu",
    "TopoMatrix",
    "build_topology",
    "detect_topology",
    "matrix_levels",
    "named_topology",
    "parse_gpu_query",
    "parse_topo_matrix",
    "pcie_link_gb_per_s",
]

# Relation levels, ordered like NVML's nvmlGpuTopologyLevel_t (reference/hardware.md):
# 0 same board, 10 one switch, 20 several switches, 30 host bridge, 40 NUMA node, 50 system.
LEVEL_SWITCH = 10
LEVEL_SWITCHES = 20
LEVEL_HOST_BRIDGE = 30
LEVEL_NUMA_NODE = 40
LEVEL_SYSTEM = 50

# `nvidia-smi topo -m` codes; SOC is the name older drivers print for SYS.
_MATRIX_LEVELS = {
    "X": 0,
    "PIX": LEVEL_SWITCH,
    "PXB": LEVEL_SWITCHES,
    "PHB": LEVEL_HOST_BRIDGE,
    "NODE": LEVEL_NUMA_NODE,
    "SYS": LEVEL_SYSTEM,
    "SOC": LEVEL_SYSTEM,
}

# Measured x16 bandwidth per direction, GB/s. Gen3-5 are the preset figures
# (reference/hardware.md); Gen1/2 scale the theoretical 4 and 8 GB/s by the measured/
# theoretical ratio of Gen3 (12/15.75 ~ 0.76); Gen6 assumes the usual doubling over Gen5.
_X16_GB_PER_S = {
    1: 3.0,
    2: 6.0,
    3: PCIE_GB_PER_S["gen3"],
    4: PCIE_GB_PER_S["gen4"],
    5: PCIE_GB_PER_S["gen5"],
    6: 2 * PCIE_GB_PER_S["gen5"],
}

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

# nvidia-smi's GPU query: one CSV line per GPU with these fields, memory in MiB.
_GPU_QUERY_FIELDS = ("index", "name", "memory.total", "pcie.link.gen.max", "pcie.link.width.max")
_NVIDIA_SMI_QUERY = (
    "--query-gpu=" + ",".join(_GPU_QUERY_FIELDS),
    "--format=csv,noheader,nounits",
)
# nvidia-smi's topology matrix: how each pair of GPUs is connected.
_NVIDIA_SMI_TOPOLOGY = ("topo", "-m")


@dataclass(frozen=True)
class DetectedGpu:
    """What the driver tells us about one GPU: product name, memory and PCIe link."""

    name: str
    memory_bytes: int
    pcie_generation: int
    pcie_width: int

    @property
    def link_gb_per_s(self) -> float:
        return pcie_link_gb_per_s(self.pcie_generation, self.pcie_width)


@dataclass(frozen=True)
class TopoMatrix:
    """The GPU part of `nvidia-smi topo -m`: codes per GPU pair and each GPU's NUMA node."""

    gpus: tuple[str, ...]
    codes: tuple[tuple[str, ...], ...]
    numa: tuple[int | None, ...]


def pcie_link_gb_per_s(generation: int, width: int) -> float:
    """Measured bandwidth per direction of a PCIe link: the per-lane figure times ``width``."""
    if generation < 1 or width < 1:
        raise PipeswapError(f"PCIe generation {generation} x{width} is not a working link")
    per_lane = _X16_GB_PER_S[min(generation, max(_X16_GB_PER_S))] / 16
    return per_lane * width


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the output of `nvidia-smi topo -m` (GPU rows and columns; NICs are skipped)."""
    lines = [_ANSI_ESCAPE.sub("", line) for line in text.splitlines()]
    header_index = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU0\b", line)), None)
    if header_index is None:
        raise PipeswapError(
            "nvidia-smi's topology matrix: no header row starting with GPU0 was found"
        )
    header = lines[header_index].split()
    columns = header[: header.index("CPU")] if "CPU" in header else header
    rows: dict[str, list[str]] = {}
    numa: dict[str, int | None] = {}
    for line in lines[header_index + 1 :]:
        tokens = line.split()
        if not tokens or not re.fullmatch(r"GPU\d+", tokens[0]):
            continue
        cells = tokens[1 : 1 + len(columns)]
        if len(cells) < len(columns):
            raise PipeswapError(
                f"nvidia-smi's topology matrix: row {tokens[0]} has too few columns"
            )
        rows[tokens[0]] = cells
        rest = tokens[1 + len(columns) :]
        # After the matrix come CPU affinity, then NUMA affinity (a number or N/A).
        numa[tokens[0]] = int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else None
    gpus = tuple(c for c in columns if re.fullmatch(r"GPU\d+", c))
    missing = [g for g in gpus if g not in rows]
    if missing:
        raise PipeswapError(f"nvidia-smi's topology matrix: no row for {', '.join(missing)}")
    positions = [columns.index(g) for g in gpus]
    codes = tuple(tuple(rows[g][p] for p in positions) for g in gpus)
    return TopoMatrix(gpus, codes, tuple(numa[g] for g in gpus))


def matrix_levels(matrix: TopoMatrix) -> list[list[int]]:
    """Relation levels per GPU pair; NVLink pairs (NV#) hide their PCIe relation.

    For an NV# pair we only know the NUMA nodes: the same node counts as NODE (separate
    root ports of one socket), different nodes as SYS. NVML does not have this blind spot.
    """
    levels: list[list[int]] = []
    for i, row in enumerate(matrix.codes):
        level_row = []
        for j, code in enumerate(row):
            if code in _MATRIX_LEVELS:
                level_row.append(_MATRIX_LEVELS[code])
            elif re.fullmatch(r"NV\d+", code):
                same_numa = matrix.numa[i] == matrix.numa[j]
                level_row.append(LEVEL_NUMA_NODE if same_numa else LEVEL_SYSTEM)
            else:
                raise PipeswapError(
                    f"nvidia-smi's topology matrix: unknown code {code!r} between "
                    f"{matrix.gpus[i]} and {matrix.gpus[j]}; expected one of "
                    f"{', '.join(_MATRIX_LEVELS)} or NV#"
                )
        levels.append(level_row)
    return levels


def parse_gpu_query(text: str) -> list[DetectedGpu]:
    """Parse the output of nvidia-smi's GPU query (``_NVIDIA_SMI_QUERY``): per GPU a CSV line
    of ``_GPU_QUERY_FIELDS`` without header or units (memory in MiB)."""
    gpus: list[tuple[int, DetectedGpu]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(_GPU_QUERY_FIELDS):
            raise PipeswapError(f"nvidia-smi's GPU query: cannot read line {line!r}")
        index, name, memory_mib, generation, width = fields
        try:
            gpu = DetectedGpu(name, int(memory_mib) * 2**20, int(generation), int(width))
            gpus.append((int(index), gpu))
        except ValueError:
            raise PipeswapError(f"nvidia-smi's GPU query: cannot read line {line!r}") from None
    return [gpu for _, gpu in sorted(gpus, key=lambda pair: pair[0])]


def build_topology(
    levels: Sequence[Sequence[int]],
    gpus: Sequence[DetectedGpu],
    *,
    name: str = "detected",
    copy_engines: int = 2,
) -> Topology:
    """A tree from pairwise relation levels: sockets, then switches, then GPUs.

    GPUs related below SYS share a CPU (sockets chained by the inter-socket link); within a
    socket, GPUs related at PXB or closer hang under one switch, and PIX subgroups of a PXB
    group under their own switch below it. A GPU with no such partner sits on a root port.
    A switch's uplink is not visible to NVML; we give it the fastest link below it, as
    servers give each switch an x16 uplink of the generation its GPUs run at.
    """
    count = len(gpus)
    if len(levels) != count or any(len(row) != count for row in levels):
        raise PipeswapError(f"need a {count}x{count} matrix of relation levels for {count} GPUs")
    gpu_ids = [f"gpu{i}" for i in range(count)]
    cpus: list[Node] = []
    switches: list[Node] = []
    links: list[Link] = []

    def new_switch() -> str:
        switches.append(Node(f"sw{len(switches)}", "switch"))
        return switches[-1].id

    def uplink(child: str, parent: str, members: list[int]) -> None:
        gb_per_s = max(gpus[i].link_gb_per_s for i in members)
        links.append(Link(child, parent, gb_per_s))

    sockets = _groups(range(count), lambda i, j: levels[i][j] < LEVEL_SYSTEM)
    for socket in sockets:
        cpu = f"cpu{len(cpus)}"
        if cpus:
            links.append(Link(cpus[-1].id, cpu, INTER_SOCKET_GB_PER_S, kind=INTER_SOCKET_KIND))
        cpus.append(Node(cpu, "cpu"))
        for top in _groups(socket, lambda i, j: levels[i][j] <= LEVEL_SWITCHES):
            if len(top) == 1:
                uplink(gpu_ids[top[0]], cpu, top)
                continue
            top_switch = new_switch()
            uplink(top_switch, cpu, top)
            leaves = _groups(top, lambda i, j: levels[i][j] <= LEVEL_SWITCH)
            for leaf in leaves:
                parent = top_switch
                if len(leaf) > 1 and len(leaves) > 1:
                    parent = new_switch()
                    uplink(parent, top_switch, leaf)
                for i in leaf:
                    uplink(gpu_ids[i], parent, [i])
    gpu_nodes = [Node(gpu_ids[i], "gpu", copy_engines, gpus[i].memory_bytes) for i in range(count)]
    return Topology(name, tuple(cpus + switches + gpu_nodes), tuple(links))


def named_topology(name: str) -> Topology:
    """The topology ``name`` says (the field ``topology``): a preset, a topology JSON
    file, or ``detect``, this machine's GPUs (refused where none is found)."""
    if name != "detect":
        return resolve_topology(name)
    found = detect_topology()
    require(
        found is not None,
        "{topology} detect found no NVIDIA GPU here; name a preset (switch-4, "
        "single-root-8, dual-root-8, direct-4) or a topology JSON file",
    )
    assert found is not None
    return found


def detect_topology(*, copy_engines: int = 2) -> Topology | None:
    """This machine's GPUs as a Topology, or None when no NVIDIA GPU is found.

    NVML (package nvidia-ml-py) is asked first; without it, `nvidia-smi` is parsed.
    NVML does not report copy engines: ``copy_engines`` is given to every GPU.
    """
    found = _query_nvml()
    if found is None:
        found = _query_nvidia_smi()
    if found is None or not found[0]:
        return None
    gpus, levels = found
    return build_topology(levels, _as_torch_counts(gpus), copy_engines=copy_engines)


def _as_torch_counts(gpus: list[DetectedGpu]) -> list[DetectedGpu]:
    """The GPUs with the memory PyTorch can use: its total where it is less than the
    driver's (nvidia-smi counts memory the CUDA context never sees), so a budget of a
    GPU's whole memory is one PyTorch accepts."""
    try:
        import torch

        if not torch.cuda.is_available():
            return gpus
        usable = min(
            torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())
        )
    except (ImportError, RuntimeError):
        return gpus
    return [replace(gpu, memory_bytes=min(gpu.memory_bytes, usable)) for gpu in gpus]


def _groups(members: Sequence[int] | range, related: Callable[[int, int], bool]) -> list[list[int]]:
    """Connected components of ``members`` under ``related``, each sorted, ordered by first."""
    members = list(members)
    sets = UnionFind(members)
    for position, i in enumerate(members):
        for j in members[position + 1 :]:
            if related(i, j) or related(j, i):
                sets.union(i, j)
    return sorted(sets.groups(), key=lambda group: group[0])


def _query_nvml() -> tuple[list[DetectedGpu], list[list[int]]] | None:
    try:
        # Here, not at the top: NVML's bindings are optional (pip install nvidia-ml-py).
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        gpus = [_nvml_gpu(pynvml, handle) for handle in handles]
        levels = [
            [
                0 if i == j else int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
                for j, b in enumerate(handles)
            ]
            for i, a in enumerate(handles)
        ]
        return gpus, levels
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_gpu(nvml: Any, handle: Any) -> DetectedGpu:
    """One GPU's facts; ``nvml`` is the pynvml module (optional, so typed loosely)."""

    def link(maximum: str, current: str) -> int:
        # An idle GPU drops its link to Gen1 to save power, so the current generation
        # understates what copies get; the maximum is what the link trains to under load.
        try:
            return int(getattr(nvml, maximum)(handle))
        except nvml.NVMLError:
            return int(getattr(nvml, current)(handle))

    name = nvml.nvmlDeviceGetName(handle)
    return DetectedGpu(
        name=name.decode() if isinstance(name, bytes) else str(name),
        memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        pcie_generation=link(
            "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkGeneration"
        ),
        pcie_width=link("nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetCurrPcieLinkWidth"),
    )


def _query_nvidia_smi() -> tuple[list[DetectedGpu], list[list[int]]] | None:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None

    def output(arguments: tuple[str, ...]) -> str:
        return subprocess.run(
            [executable, *arguments], capture_output=True, text=True, timeout=60, check=True
        ).stdout

    try:
        listing = output(_NVIDIA_SMI_QUERY)
        if not listing.strip():
            return None
        matrix = output(_NVIDIA_SMI_TOPOLOGY)
    except (OSError, subprocess.SubprocessError):
        # nvidia-smi without a loaded driver or without devices exits non-zero.
        return None
    gpus = parse_gpu_query(listing)
    levels = matrix_levels(parse_topo_matrix(matrix))
    if len(levels) != len(gpus):
        raise ConfigError(
            f"nvidia-smi lists {len(gpus)} GPUs but its topology matrix has {len(levels)}; "
            "write the topology as JSON by hand (see `pipeswap topology show switch-4 {json}`)"
        )
    return gpus, levels
