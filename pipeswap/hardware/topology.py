"""The Topology contract (pipeswap.topology/1): GPUs, PCIe switches and CPUs as a tree."""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.hardware.unionfind import UnionFind
from pipeswap.jsonio import check_format, dump_json, load_json

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
            raise PipeswapError(f"topology {self.name!r} has no node {node_id!r}; nodes: {known}") from None

    @property
    def gpus(self) -> list[str]:
        return [n.id for n in self.nodes if n.kind == "gpu"]

    @property
    def cpus(self) -> list[str]:
        return [n.id for n in self.nodes if n.kind == "cpu"]

    def path(self, src: str, dst: str) -> list[Hop]:
        """The hops from ``src`` to ``dst`` along the tree (empty when they are equal)."""
        paths = self._paths(src)
        if dst not in paths:
            self.node(dst)
            raise PipeswapError(f"topology {self.name!r}: no path from {src!r} to {dst!r}; link them")
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
        return Topology(self.name, nodes, self.links)

    # ---- JSON -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": TOPOLOGY_FORMAT,
            "name": self.name,
            "nodes": [n.to_json() for n in self.nodes],
            "links": [link.to_json() for link in self.links],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "topology") -> Topology:
        check_format(obj, TOPOLOGY_FORMAT, where)
        try:
            nodes = tuple(
                Node(
                    id=str(n["id"]),
                    kind=str(n["kind"]),
                    copy_engines=int(n.get("copy_engines", 2)),
                    memory_bytes=int(n.get("memory_bytes", 0)),
                    spec=n.get("spec"),
                )
                for n in obj["nodes"]
            )
            links = tuple(
                Link(
                    a=str(link["a"]),
                    b=str(link["b"]),
                    gb_per_s=float(link["gb_per_s"]),
                    duplex_efficiency=float(link.get("duplex_efficiency", 1.0)),
                    kind=str(link.get("kind", "pcie")),
                )
                for link in obj["links"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PipeswapError(f"{where}: malformed topology ({exc!r})") from None
        return cls(name=str(obj.get("name", "unnamed")), nodes=nodes, links=links)

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        return cls.from_json(load_json(path), where=str(path))


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
        if node.memory_bytes < 0:
            raise PipeswapError(
                f"topology {name!r}: {node.kind} {node.id!r} has negative memory_bytes"
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
