"""A Topology as a text tree rooted at its CPUs, with every link's bandwidth."""

from __future__ import annotations

from pipeswap.hardware.topology import Link, Node, Topology

__all__ = ["render_tree"]


def render_tree(topology: Topology) -> str:
    """The topology drawn as one tree per CPU, links between CPUs shown between the trees.

    Example::

        switch-4: 4 GPUs, 1 CPU, 2 switches
        cpu0 (CPU)
        ├── 12.0 GB/s ── sw0 (switch)
        │   ├── 12.0 GB/s ── gpu0 (GPU: 32 GiB, 2 copy engines)
        ...
    """
    kinds = [n.kind for n in topology.nodes]
    lines = [
        f"{topology.name}: {_count(kinds.count('gpu'), 'GPU')}, "
        f"{_count(kinds.count('cpu'), 'CPU')}, {_count(kinds.count('switch'), 'switch')}"
    ]
    neighbours = _neighbours(topology)
    drawn: set[str] = set()
    cpus = topology.cpus
    for position, cpu in enumerate(cpus):
        for link in topology.links:
            ends = {link.a, link.b}
            if cpu in ends and (ends - {cpu}) & set(cpus[:position]):
                other = link.a if link.b == cpu else link.b
                lines.append(f"{other} ══ {_link_label(link)} ══ {cpu}")
        lines.append(_node_label(topology.node(cpu)))
        drawn.add(cpu)
        _draw_children(topology, neighbours, cpu, "", drawn, lines)
    stray = [n.id for n in topology.nodes if n.id not in drawn]
    if stray:
        lines.append("not connected to a CPU:")
        for node_id in stray:
            if node_id not in drawn:
                lines.append(_node_label(topology.node(node_id)))
                drawn.add(node_id)
                _draw_children(topology, neighbours, node_id, "", drawn, lines)
    return "\n".join(lines) + "\n"


def _neighbours(topology: Topology) -> dict[str, list[tuple[str, Link]]]:
    neighbours: dict[str, list[tuple[str, Link]]] = {n.id: [] for n in topology.nodes}
    for link in topology.links:
        neighbours[link.a].append((link.b, link))
        neighbours[link.b].append((link.a, link))
    return neighbours


def _draw_children(
    topology: Topology,
    neighbours: dict[str, list[tuple[str, Link]]],
    node_id: str,
    indent: str,
    drawn: set[str],
    lines: list[str],
) -> None:
    is_cpu = topology.node(node_id).kind == "cpu"
    children = [
        (child, link)
        for child, link in neighbours[node_id]
        if child not in drawn and not (is_cpu and topology.node(child).kind == "cpu")
    ]
    for position, (child, link) in enumerate(children):
        last = position == len(children) - 1
        branch, further = ("└── ", "    ") if last else ("├── ", "│   ")
        node = topology.node(child)
        drawn.add(child)
        if node.kind == "cpu":
            # Another socket reached through a bridge: its own tree follows as a root.
            lines.append(f"{indent}{branch}{_link_label(link)} ── {child} (CPU, tree below)")
            continue
        lines.append(f"{indent}{branch}{_link_label(link)} ── {_node_label(node)}")
        _draw_children(topology, neighbours, child, indent + further, drawn, lines)


def _link_label(link: Link) -> str:
    label = f"{link.gb_per_s:.1f} GB/s"
    if link.duplex_efficiency != 1.0:
        label += f" (duplex {link.duplex_efficiency:g})"
    if link.kind != "pcie":
        label += f" {link.kind}"
    return label


def _node_label(node: Node) -> str:
    if node.kind == "cpu":
        return f"{node.id} (CPU)"
    if node.kind == "switch":
        return f"{node.id} (switch)"
    details = [node.spec] if node.spec else []
    details.append(_memory(node.memory_bytes))
    details.append(_count(node.copy_engines, "copy engine"))
    return f"{node.id} (GPU: {', '.join(details)})"


def _memory(memory_bytes: int) -> str:
    if memory_bytes == 0:
        return "memory unlimited"
    return f"{round(memory_bytes / 2**30, 1):g} GiB"


def _count(number: int, noun: str) -> str:
    plural = "es" if noun.endswith("h") else "s"
    return f"{number} {noun}" if number == 1 else f"{number} {noun}{plural}"
