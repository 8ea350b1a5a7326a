"""Which GPUs share a PCIe channel to host memory, and the bandwidth each can count on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeswap.hardware.topology import Topology
from pipeswap.hardware.unionfind import UnionFind

__all__ = [
    "channel_groups",
    "group_shape",
    "host_links",
    "path_bytes_per_s",
    "representative_group",
    "shared_links",
]


def host_links(topology: Topology, gpu: str) -> list[int]:
    """Indices of the links a swap of ``gpu`` crosses on its way to its host memory."""
    return [link for link, _ in topology.path(gpu, topology.host_of(gpu))]


def channel_groups(topology: Topology, gpus: Sequence[str]) -> list[list[str]]:
    """``gpus`` split into groups whose swaps share at least one link (transitively).

    Groups keep the order of ``gpus``; GPUs with a private path form groups of one.
    """
    sets = UnionFind(gpus)
    owner: dict[int, str] = {}  # the first GPU seen crossing each link
    for gpu in gpus:
        for link in host_links(topology, gpu):
            if link in owner:
                sets.union(gpu, owner[link])
            else:
                owner[link] = gpu
    return sets.groups()


def path_bytes_per_s(topology: Topology, gpu: str) -> float:
    """The bandwidth of ``gpu``'s path to host when it has the path to itself."""
    return min(topology.links[link].bytes_per_s for link in host_links(topology, gpu))


def shared_links(topology: Topology, group: Sequence[str]) -> dict[int, list[str]]:
    """Links crossed by the swaps of two or more GPUs of ``group``, with those GPUs."""
    users: dict[int, list[str]] = {}
    for gpu in group:
        for link in host_links(topology, gpu):
            users.setdefault(link, []).append(gpu)
    return {link: members for link, members in users.items() if len(members) > 1}


def group_shape(topology: Topology, group: Sequence[str]) -> tuple[Any, ...]:
    """What a plan for ``group`` depends on: its members' paths, copy engines and shared
    links (by bandwidth and member positions). Groups of equal shape are interchangeable."""
    position = {gpu: k for k, gpu in enumerate(group)}
    shared = sorted(
        (topology.links[link].bytes_per_s, tuple(sorted(position[g] for g in members)))
        for link, members in shared_links(topology, group).items()
    )
    own = tuple(path_bytes_per_s(topology, g) for g in group)
    engines = tuple(topology.node(g).copy_engines for g in group)
    return (own, engines, tuple(shared))


def representative_group(topology: Topology, gpus: Sequence[str]) -> list[str] | None:
    """One channel group standing for all, when there are several and all have one shape
    (presets repeat a switch of two GPUs); None otherwise."""
    groups = channel_groups(topology, gpus)
    if len(groups) < 2:
        return None
    shapes = {group_shape(topology, group) for group in groups}
    return groups[0] if len(shapes) == 1 else None
