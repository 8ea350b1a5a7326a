"""`pipeswap topology`: list presets, show a topology as a tree or JSON, detect this machine's."""

from __future__ import annotations

import argparse
import json

from pipeswap.hardware.detect import detect_topology
from pipeswap.hardware.presets import (
    PCIE_GB_PER_S,
    preset_description,
    preset_names,
    resolve_topology,
)
from pipeswap.hardware.render import render_tree
from pipeswap.hardware.topology import Topology


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "topology",
        help="list, show or detect PCIe topologies",
        description="PCIe topologies: GPUs, switches and CPUs with their link bandwidths.",
    )
    parser.set_defaults(func=run, topology_parser=parser)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    listing = actions.add_parser("list", help="the preset names with a one-line description")
    listing.set_defaults(topology_action=_list)

    show = actions.add_parser("show", help="a preset or a topology JSON file as a tree or JSON")
    show.add_argument("topology", metavar="NAME|FILE", help="a preset name or a topology JSON file")
    show.add_argument(
        "--pcie",
        choices=list(PCIE_GB_PER_S),
        default=None,
        help="PCIe generation of a preset's links (default gen3; measured x16 bandwidth)",
    )
    show.add_argument("--json", action="store_true", help="print pipeswap.topology/1 JSON")
    show.set_defaults(topology_action=_show)

    detect = actions.add_parser("detect", help="this machine's NVIDIA GPUs (NVML or nvidia-smi)")
    detect.add_argument("--json", action="store_true", help="print pipeswap.topology/1 JSON")
    detect.set_defaults(topology_action=_detect)


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "topology_action", None)
    if action is None:
        args.topology_parser.print_help()
        return 2
    return int(action(args))


def _list(args: argparse.Namespace) -> int:
    width = max(len(name) for name in preset_names())
    for name in preset_names():
        print(f"{name:<{width}}  {preset_description(name)}")
    return 0


def _show(args: argparse.Namespace) -> int:
    _print(resolve_topology(args.topology, pcie=args.pcie), as_json=args.json)
    return 0


def _detect(args: argparse.Namespace) -> int:
    topology = detect_topology()
    if topology is None:
        print("no NVIDIA GPU was found (neither NVML nor nvidia-smi reports one)")
        return 0
    _print(topology, as_json=args.json)
    return 0


def _print(topology: Topology, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(topology.to_json(), indent=1))
    else:
        print(render_tree(topology), end="")
