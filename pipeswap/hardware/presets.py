"""Named server shapes (switch-4, single-root-8, dual-root-8, direct-4) as Topology objects."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import Link, Node, Topology

__all__ = [
    "DEFAULT_GPU_MEMORY_BYTES",
    "INTER_SOCKET_GB_PER_S",
    "INTER_SOCKET_KIND",
    "PCIE_GB_PER_S",
    "pcie_gb_per_s",
    "preset",
    "preset_description",
    "preset_names",
    "resolve_topology",
    "topology_file",
]

# Measured x16 bandwidth per direction with pinned host memory (reference/hardware.md,
# "PCIe, x16, per direction"): Gen3 12-13 GB/s (P100: 12.2 H2D, 12.9 D2H), Gen4 25-27 GB/s
# (A100, RTX 4090), Gen5 50-55 GB/s (H100-class D2H). We take the low end of each range:
# planning for the bandwidth copies reliably reach, not the best case.
PCIE_GB_PER_S: dict[str, float] = {"gen3": 12.0, "gen4": 25.0, "gen5": 50.0}

# QPI/UPI carry about 20 GB/s per direction per link (reference/hardware.md).
INTER_SOCKET_GB_PER_S = 20.0
INTER_SOCKET_KIND = "inter-socket"

DEFAULT_GPU_MEMORY_BYTES = 32 * 2**30


@dataclass(frozen=True)
class _Shape:
    """``sockets`` CPUs, each with ``switches`` PCIe switches of ``gpus_per_port`` GPUs.

    ``switches == 0`` puts ``gpus_per_port`` GPUs per socket directly on CPU root ports.
    """

    description: str
    sockets: int
    switches: int
    gpus_per_port: int


_SHAPES: dict[str, _Shape] = {
    "switch-4": _Shape("one CPU, two PCIe switches, two GPUs behind each", 1, 2, 2),
    "single-root-8": _Shape(
        "eight GPUs on one CPU root complex: four PCIe switches, two GPUs behind each", 1, 4, 2
    ),
    "dual-root-8": _Shape(
        "two CPUs joined by the inter-socket link, each with two PCIe switches of two GPUs",
        2,
        2,
        2,
    ),
    "direct-4": _Shape("four GPUs, each on its own CPU root port (no shared uplink)", 1, 0, 4),
}


def preset_names() -> list[str]:
    """The names ``preset`` accepts, in a stable order."""
    return list(_SHAPES)


def preset_description(name: str) -> str:
    """A one-line description of preset ``name``."""
    return _shape(name).description


def pcie_gb_per_s(pcie: str) -> float:
    """Measured x16 bandwidth per direction of PCIe generation ``pcie`` ("gen3"/"gen4"/"gen5")."""
    try:
        return PCIE_GB_PER_S[pcie]
    except KeyError:
        raise PipeswapError(
            f"unknown PCIe generation {pcie!r}; use one of {', '.join(PCIE_GB_PER_S)}"
        ) from None


def preset(
    name: str,
    *,
    pcie: str = "gen3",
    gpu_memory_bytes: int = DEFAULT_GPU_MEMORY_BYTES,
    copy_engines: int = 2,
    duplex_efficiency: float = 1.0,
    spec: str | None = None,
) -> Topology:
    """The server shape ``name`` with every PCIe link x16 of generation ``pcie``.

    ``duplex_efficiency`` applies to the PCIe links (the inter-socket link stays 1.0);
    ``spec`` names the GPU model (a pipeswap.hardware.gpus name) on every GPU node.
    The name is the preset name, with ``:gen4``/``:gen5`` appended for non-default PCIe,
    which ``resolve_topology`` accepts back.
    """
    shape = _shape(name)
    gb_per_s = pcie_gb_per_s(pcie)
    nodes: list[Node] = []
    links: list[Link] = []

    def pcie_link(a: str, b: str) -> Link:
        return Link(a, b, gb_per_s, duplex_efficiency=duplex_efficiency)

    gpu_index = switch_index = 0
    for socket in range(shape.sockets):
        cpu = f"cpu{socket}"
        nodes.append(Node(cpu, "cpu"))
        if socket > 0:
            links.append(
                Link(f"cpu{socket - 1}", cpu, INTER_SOCKET_GB_PER_S, kind=INTER_SOCKET_KIND)
            )
        ports = [(cpu, shape.gpus_per_port)]
        if shape.switches:
            ports = []
            for _ in range(shape.switches):
                switch = f"sw{switch_index}"
                switch_index += 1
                nodes.append(Node(switch, "switch"))
                links.append(pcie_link(switch, cpu))
                ports.append((switch, shape.gpus_per_port))
        for parent, count in ports:
            for _ in range(count):
                gpu = f"gpu{gpu_index}"
                gpu_index += 1
                nodes.append(Node(gpu, "gpu", copy_engines, gpu_memory_bytes, spec))
                links.append(pcie_link(gpu, parent))
    full_name = name if pcie == "gen3" else f"{name}:{pcie}"
    return Topology(full_name, tuple(nodes), tuple(links))


def resolve_topology(
    name_or_path: str,
    *,
    pcie: str | None = None,
    gpu_memory_bytes: int | None = None,
    copy_engines: int | None = None,
    duplex_efficiency: float | None = None,
    spec: str | None = None,
) -> Topology:
    """A preset name (optionally ``NAME:genN``) or the path of a topology JSON file.

    Options left as None keep the preset defaults. For a JSON file only
    ``gpu_memory_bytes`` applies (it overrides every GPU's memory); the other options
    describe how to build a preset and are refused, since the file already says them.
    """
    base, _, suffix = name_or_path.partition(":")
    if base in _SHAPES:
        if suffix and pcie is not None and pcie != suffix:
            raise PipeswapError(
                f"{name_or_path!r} asks for PCIe {suffix} but pcie={pcie!r} was also given; "
                "give the generation once"
            )
        return preset(
            base,
            pcie=suffix or pcie or "gen3",
            gpu_memory_bytes=DEFAULT_GPU_MEMORY_BYTES
            if gpu_memory_bytes is None
            else gpu_memory_bytes,
            copy_engines=2 if copy_engines is None else copy_engines,
            duplex_efficiency=1.0 if duplex_efficiency is None else duplex_efficiency,
            spec=spec,
        )
    if os.path.isdir(name_or_path):
        raise PipeswapError(
            f"{name_or_path} is a directory; give a topology JSON file or a preset name "
            f"({', '.join(_SHAPES)})"
        )
    if os.path.isfile(name_or_path) or name_or_path.endswith(".json"):
        given = {
            "pcie": pcie,
            "copy_engines": copy_engines,
            "duplex_efficiency": duplex_efficiency,
            "spec": spec,
        }
        refused = [key for key, value in given.items() if value is not None]
        if refused:
            raise PipeswapError(
                f"{', '.join(refused)} only apply to preset topologies; edit {name_or_path} "
                "instead, or use a preset name"
            )
        topology = Topology.load(name_or_path)
        if gpu_memory_bytes is not None:
            topology = topology.with_gpu_memory(gpu_memory_bytes)
        return topology
    raise ConfigError(
        f"unknown topology {name_or_path!r}: use a preset ({', '.join(_SHAPES)}; "
        "append :gen4 or :gen5 for faster PCIe) or the path of a topology JSON file "
        "(see `pipeswap topology show NAME {json}`)"
    )


def topology_file(name_or_path: str) -> str | None:
    """The file a topology name or path names, or None for a preset (a preset wins, as in
    resolve_topology), so callers can refuse an output that would overwrite it."""
    if name_or_path.partition(":")[0] in _SHAPES:
        return None
    return name_or_path


def _shape(name: str) -> _Shape:
    try:
        return _SHAPES[name]
    except KeyError:
        raise PipeswapError(
            f"unknown topology preset {name!r}; presets: {', '.join(_SHAPES)}"
        ) from None
