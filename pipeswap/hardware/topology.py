"""The Topology contract (pipeswap.topology/1): GPUs, PCIe switches and CPUs as a tree."""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.hardware.unionfind import UnionFind
from pipeswap.json_fields import (
    as_object,
    list_field,
    only_known,
    seconds_field,
    shown,
    text_field,
)
from pipeswap.jsonio import check_format, dump_json, load_json

__all__ = ["GB", "NODE_KINDS", "TOPOLOGY_FORMAT", "Hop", "Link", "Node", "Topology"]

TOPOLOGY_FORMAT = "pipeswap.topology/1"
NODE_KINDS = ("gpu", "switch", "cpu")
GB = 1e9


@dataclass(frozen=True)
class Node:
    """A GPU, a PCIe switch or a CPU (root complex and its NUMA-local host memory)."""

    id: str
    kind: str
    copy_engines: int = 2
    memory_bytes: int = 0
    spec: str | None = None

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": self.id, "kind": self.kind}
        if self.kind == "gpu":
            obj["copy_engines"] = self.copy_engines
            obj["memory_bytes"] = self.memory_bytes
        if self.spec is not None:
            obj["spec"] = self.spec
        return obj


@dataclass(frozen=True)
class Link:
    """An undirected link; ``gb_per_s`` is the bandwidth of each direction (1e9 B/s).

    ``duplex_efficiency`` scales each direction's bandwidth while both directions carry
    traffic (1.0 = perfect full duplex; some A100 hosts behave like 0.5 for H2D).
    """

    a: str
    b: str
    gb_per_s: float
    duplex_efficiency: float = 1.0
    kind: str = "pcie"

    @property
    def bytes_per_s(self) -> float:
        return self.gb_per_s * GB

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"a": self.a, "b": self.b, "gb_per_s": self.gb_per_s}
        if self.duplex_efficiency != 1.0:
            obj["duplex_efficiency"] = self.duplex_efficiency
        if self.kind != "pcie":
            obj["kind"] = self.kind
        return obj


# A hop along a path: (index of the link in Topology.links, direction).
# Direction 0 goes from link.a to link.b, direction 1 from link.b to link.a.
Hop = tuple[int, int]


@dataclass(frozen=True)
class Topology:
    """A server as a tree of nodes; traffic follows the unique tree path.

    Construction validates: unknown link ends, duplicate ids, non-positive bandwidth,
    cycles, and GPUs with no path to a CPU are refused with a message naming them.
    """

    name: str
    nodes: tuple[Node, ...]
    links: tuple[Link, ...]
    # What `pipeswap topology calibrate` measured to make it (pipeswap.calibration/1), if so.
    calibration: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ---- lookups --------------------------------------------------------------------
    @cached_property
    def _by_id(self) -> dict[str, Node]:
        return {node.id: node for node in self.nodes}

    @cached_property
    def _adjacency(self) -> dict[str, list[tuple[str, int, int]]]:
        adjacency: dict[str, list[tuple[str, int, int]]] = {n.id: [] for n in self.nodes}
        for index, link in enumerate(self.links):
            adjacency[link.a].append((link.b, index, 0))
            adjacency[link.b].append((link.a, index, 1))
        return adjacency

    def node(self, node_id: str) -> Node:
        try:
            return self._by_id[node_id]
        except KeyError:
            known = ", ".join(n.id for n in self.nodes)
            raise PipeswapError(
                f"topology {self.name!r} has no node {node_id!r}; nodes: {known}"
            ) from None

    @property
    def gpus(self) -> list[str]:
        return [n.id for n in self.nodes if n.kind == "gpu"]

    def require_gpus(self, source: str | None = None) -> list[str]:
        """The GPUs, or a PipeswapError when there are none.

        A topology with no GPU is valid on its own (``topology show`` prints it), but
        simulating or planning on it has nothing to run on; ``source`` is what the user
        wrote (a preset or a file) when it differs from the name.
        """
        gpus = self.gpus
        if not gpus:
            where = "" if source in (None, self.name) else f" (from {source})"
            raise PipeswapError(
                f"topology {self.name!r}{where} has no GPU; add a node with kind gpu "
                '(e.g. {"id": "gpu0", "kind": "gpu", "memory_bytes": 34359738368}) '
                "linked to a switch or cpu"
            )
        return gpus

    @property
    def cpus(self) -> list[str]:
        return [n.id for n in self.nodes if n.kind == "cpu"]

    def path(self, src: str, dst: str) -> list[Hop]:
        """The hops from ``src`` to ``dst`` along the tree (empty when they are equal)."""
        paths = self._paths(src)
        if dst not in paths:
            self.node(dst)
            raise PipeswapError(
                f"topology {self.name!r}: no path from {src!r} to {dst!r}; link them"
            )
        return list(paths[dst])

    def _paths(self, src: str) -> dict[str, tuple[Hop, ...]]:
        cache = self.__dict__.setdefault("_path_cache", {})
        if src not in cache:
            self.node(src)
            paths: dict[str, tuple[Hop, ...]] = {src: ()}
            queue = deque([src])
            while queue:
                here = queue.popleft()
                for there, index, direction in self._adjacency[here]:
                    if there not in paths:
                        paths[there] = paths[here] + ((index, direction),)
                        queue.append(there)
            cache[src] = paths
        return cache[src]

    def host_of(self, gpu: str) -> str:
        """The CPU node nearest to ``gpu`` (fewest hops): its NUMA-local host memory."""
        self.node(gpu)
        paths = self._paths(gpu)
        cpus = [c for c in self.cpus if c in paths]
        return min(cpus, key=lambda c: (len(paths[c]), c))

    def with_gpu_memory(self, memory_bytes: int) -> Topology:
        """The same topology with every GPU's memory set to ``memory_bytes``."""
        nodes = tuple(
            Node(n.id, n.kind, n.copy_engines, memory_bytes, n.spec) if n.kind == "gpu" else n
            for n in self.nodes
        )
        return Topology(self.name, nodes, self.links, self.calibration)

    # ---- JSON -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": TOPOLOGY_FORMAT,
            "name": self.name,
            "nodes": [n.to_json() for n in self.nodes],
            "links": [link.to_json() for link in self.links],
            **({"calibration": self.calibration} if self.calibration is not None else {}),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "topology") -> Topology:
        """A topology from its JSON; a missing or mistyped field is a PipeswapError naming
        the node or link and what to write (the constructor then checks the tree)."""
        obj = as_object(obj, where)
        check_format(obj, TOPOLOGY_FORMAT, where)
        # The "malformed topology" prefix tells a reader it is the file, not the request.
        bad = f"{where}: malformed topology"
        name = text_field(obj, "name", bad, "unnamed")
        nodes = tuple(
            _node_from_json(n, f"{bad}: node {i}")
            for i, n in enumerate(list_field(obj, "nodes", bad))
        )
        links = tuple(
            _link_from_json(link, f"{bad}: link {i}")
            for i, link in enumerate(list_field(obj, "links", bad))
        )
        calibration = obj.get("calibration")
        if calibration is not None:
            _check_calibration(as_object(calibration, f"{bad}: calibration"), f"{bad}: calibration")
        return cls(name=name, nodes=nodes, links=links, calibration=calibration)

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        return cls.from_json(load_json(path), where=str(path))


# ---- checked JSON fields ---------------------------------------------------------------
# int("1.7") fails but int(1.7) is 1: unchecked, a memory_bytes of 1.7 became one byte.
# So numbers are taken only as JSON numbers, and bool (Python's 1) is refused as a number.
def _json_whole(obj: dict[str, Any], key: str, where: str, default: int, what: str) -> int:
    value = obj.get(key, default)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # 3.4e10 is a whole number written the short way
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PipeswapError(f"{where}: {key} is {shown(value)}; write {what}")
    return value


# The range of a link's bandwidth a topology may give (1 KB/s to 1 PB/s per direction).
_SLOWEST_GB_PER_S = 1e-6
_FASTEST_GB_PER_S = 1e6


def _json_positive(
    obj: dict[str, Any], key: str, where: str, default: float | None, what: str
) -> float:
    if key not in obj and default is None:
        raise PipeswapError(f"{where}: {key} is missing; add {what}")
    value = obj.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise PipeswapError(f"{where}: {key} is {shown(value)}; write {what}")
    return float(value)


def _check_rate(gb_per_s: float, said: str) -> None:
    """Refuse a bandwidth no link has: beyond the range the simulator's rates overflow."""
    if not _SLOWEST_GB_PER_S <= gb_per_s <= _FASTEST_GB_PER_S:
        raise PipeswapError(
            f"{said}; write one between {_SLOWEST_GB_PER_S:g} and {_FASTEST_GB_PER_S:g} GB/s"
        )


def _check_calibration(calibration: dict[str, Any], where: str) -> None:
    """The measurements the simulator times collectives and compute by: each checked, as a
    negative latency would silently shorten every step."""
    for kind, rate in (("allreduce", "bus_gb_per_s"), ("p2p", "gb_per_s")):
        measured = calibration.get(kind)
        if measured is None:
            continue
        measured = as_object(measured, f"{where} {kind}")
        seconds_field(measured, "latency_s", f"{where} {kind}")
        speed = _json_positive(measured, rate, f"{where} {kind}", None, "a bandwidth in GB/s")
        _check_rate(speed, f"{where} {kind}: {rate} is {speed:g}")
    slowdown = calibration.get("compute_slowdown")
    if slowdown is not None:
        _json_positive(calibration, "compute_slowdown", where, None, "a factor > 0, e.g. 1.05")


def _node_from_json(n: Any, where: str) -> Node:
    n = as_object(n, where)
    node_id = text_field(n, "id", where)
    where = f"{where} ({node_id!r})"
    only_known(n, ("id", "kind", "copy_engines", "memory_bytes", "spec"), where)
    spec = n.get("spec")
    if spec is not None and not isinstance(spec, str):
        raise PipeswapError(
            f"{where}: spec is {shown(spec)}; write a GPU spec name or leave it out"
        )
    return Node(
        id=node_id,
        kind=text_field(n, "kind", where),
        copy_engines=_json_whole(n, "copy_engines", where, 2, "1 or 2"),
        memory_bytes=_json_whole(
            n, "memory_bytes", where, 0, "a whole number of bytes >= 0 (0 = unlimited)"
        ),
        spec=spec,
    )


def _link_from_json(link: Any, where: str) -> Link:
    link = as_object(link, where)
    a, b = text_field(link, "a", where), text_field(link, "b", where)
    where = f"{where} ({a}-{b})"
    only_known(link, ("a", "b", "gb_per_s", "duplex_efficiency", "kind"), where)
    return Link(
        a=a,
        b=b,
        gb_per_s=_json_positive(
            link, "gb_per_s", where, None, "a finite bandwidth > 0 in GB/s, e.g. 12.0"
        ),
        duplex_efficiency=_json_positive(
            link, "duplex_efficiency", where, 1.0, "a number in (0, 1], e.g. 0.5"
        ),
        kind=text_field(link, "kind", where, "pcie"),
    )


def _validate(topology: Topology) -> None:
    name = topology.name
    seen: set[str] = set()
    for node in topology.nodes:
        if node.id in seen:
            raise PipeswapError(f"topology {name!r}: node id {node.id!r} appears twice")
        seen.add(node.id)
        if node.kind not in NODE_KINDS:
            raise PipeswapError(
                f"topology {name!r}: node {node.id!r} has kind {node.kind!r}; "
                f"use one of {', '.join(NODE_KINDS)}"
            )
        if node.kind == "gpu" and node.copy_engines not in (1, 2):
            raise PipeswapError(
                f"topology {name!r}: gpu {node.id!r} has copy_engines={node.copy_engines}; use 1 or 2"
            )
        if isinstance(node.memory_bytes, bool) or not isinstance(node.memory_bytes, int):
            raise PipeswapError(
                f"topology {name!r}: {node.kind} {node.id!r} has memory_bytes "
                f"{node.memory_bytes!r}; use a whole number of bytes (0 = unlimited)"
            )
        if node.memory_bytes < 0:
            raise PipeswapError(
                f"topology {name!r}: {node.kind} {node.id!r} has negative memory_bytes "
                f"({node.memory_bytes}); use a whole number of bytes >= 0 (0 = unlimited)"
            )
    if not any(n.kind == "cpu" for n in topology.nodes):
        raise PipeswapError(f"topology {name!r} has no cpu node: add one for host memory")
    # Union-find finds both the link that closes a cycle and GPUs cut off from every cpu.
    sets = UnionFind(seen)
    for link in topology.links:
        where = f"link {link.a}-{link.b}"
        for end in (link.a, link.b):
            if end not in seen:
                raise PipeswapError(f"topology {name!r}: {where} is dangling: no node {end!r}")
        if link.a == link.b:
            raise PipeswapError(f"topology {name!r}: {where} joins a node to itself")
        if not (math.isfinite(link.gb_per_s) and link.gb_per_s > 0):
            raise PipeswapError(
                f"topology {name!r}: {where} has bandwidth {link.gb_per_s} GB/s; it must be positive"
            )
        _check_rate(link.gb_per_s, f"topology {name!r}: {where} has bandwidth {link.gb_per_s} GB/s")
        if not 0 < link.duplex_efficiency <= 1:
            raise PipeswapError(
                f"topology {name!r}: {where} has duplex_efficiency {link.duplex_efficiency}; "
                "use a value in (0, 1]"
            )
        if not sets.union(link.a, link.b):
            raise PipeswapError(
                f"topology {name!r}: {where} closes a cycle; PCIe topologies are trees, "
                "remove one link of the cycle"
            )
    cpu_roots = {sets.find(n.id) for n in topology.nodes if n.kind == "cpu"}
    for node in topology.nodes:
        if node.kind == "gpu" and sets.find(node.id) not in cpu_roots:
            raise PipeswapError(
                f"topology {name!r}: gpu {node.id!r} has no path to a cpu; link it to a switch or cpu"
            )
