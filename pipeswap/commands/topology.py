"""`pipeswap topology`: list presets, show a topology as a tree or JSON, detect this machine's."""

from __future__ import annotations

import argparse
import sys

from pipeswap.commands.json_out import print_json
from pipeswap.commands.options import add_options
from pipeswap.commands.settings import Outputs, TopologyOptions
from pipeswap.hardware.detect import detect_topology
from pipeswap.hardware.presets import (
    preset_description,
    preset_names,
    resolve_topology,
)
from pipeswap.hardware.render import render_tree
from pipeswap.hardware.topology import Topology
from pipeswap.train_config import TrainConfig

__all__ = ["CALIBRATE_NPROC", "register", "run"]

_JSON = "print pipeswap.topology/1 JSON"
# Ranks `topology calibrate` measures with when --nproc is not given.
CALIBRATE_NPROC = 2
_CALIBRATE_HELPS = {
    "nproc": f"ranks to measure with (default {CALIBRATE_NPROC})",
    "device": "default: cuda when PyTorch sees a GPU, else cpu",
    "out": "the topology JSON to write (default: $PIPESWAP_HOME, else ~/.cache/pipeswap, "
    "/calibrated-DEVICE-N.json, which runs of N ranks on DEVICE then plan and predict with "
    "unless {topology} names another)",
    "json": "print the calibration as JSON",
}


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
    add_options(show, TopologyOptions, only=("pcie",))
    add_options(show, Outputs, only=("json",), helps={"json": _JSON})
    show.set_defaults(topology_action=_show)

    detect = actions.add_parser("detect", help="this machine's NVIDIA GPUs (NVML or nvidia-smi)")
    add_options(detect, Outputs, only=("json",), helps={"json": _JSON})
    detect.set_defaults(topology_action=_detect)

    calibrate = actions.add_parser(
        "calibrate",
        help="measure this machine (copies, collectives, compute) into a topology JSON",
        description="Measure this machine with N ranks at once: host copies (pinned and "
        "pageable on CUDA; memory copies on the CPU), all-reduce and send/receive of the "
        "backend by size, and how much ranks computing together slow each other. Writes a "
        "topology JSON whose links carry the measured copy rate and whose calibration block "
        "holds every number, the date and this command; --topology FILE plans with it.",
    )
    add_options(calibrate, TrainConfig, only=("nproc", "device"), helps=_CALIBRATE_HELPS)
    add_options(calibrate, Outputs, only=("out",), helps=_CALIBRATE_HELPS)
    add_options(calibrate, TopologyOptions, only=("quick",))
    add_options(calibrate, Outputs, only=("json",), helps=_CALIBRATE_HELPS)
    calibrate.set_defaults(topology_action=_calibrate)


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
    _print(resolve_topology(args.topology, pcie=args.pcie), as_json=bool(args.json))
    return 0


def _detect(args: argparse.Namespace) -> int:
    topology = detect_topology()
    if topology is None:
        said = "no NVIDIA GPU was found (neither NVML nor nvidia-smi reports one)"
        if args.json:  # stdout stays JSON: none found
            print(said, file=sys.stderr)
            print_json(None)
        else:
            print(said)
        return 0
    _print(topology, as_json=bool(args.json))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from datetime import date

    import torch

    from pipeswap.config_fields import require
    from pipeswap.dist.calibrate import measure_rank
    from pipeswap.dist.group import backend_for
    from pipeswap.dist.launch import spawn
    from pipeswap.hardware.calibration import Calibration, calibrated_path, host_memory_bytes
    from pipeswap.jsonio import check_writable

    nproc = CALIBRATE_NPROC if args.nproc is None else args.nproc
    require(nproc >= 1, f"--nproc {nproc}: measure with 1 rank or more")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    require(
        device == "cpu" or torch.cuda.is_available(),
        "--device cuda, but PyTorch sees no GPU here; use --device cpu",
    )
    out = args.out or calibrated_path(device, nproc)
    check_writable(out)  # before measuring, not after
    launched = spawn(
        measure_rank, nproc, bool(args.quick), backend=backend_for(device, nproc), timeout_s=300
    )
    require(launched.ok, f"calibration failed on a rank: {launched.messages}")
    command = "pipeswap " + " ".join(sys.argv[1:])
    calibration = Calibration.from_ranks(
        launched.results, date=date.today().isoformat(), command=command
    )
    memory = (
        torch.cuda.get_device_properties(0).total_memory
        if device == "cuda"
        else host_memory_bytes() // nproc
    )
    topology = calibration.topology(f"calibrated-{device}-{nproc}", memory)
    topology.save(out)  # makes the folder it goes in
    if args.json:
        print_json(calibration.to_json())
        return 0
    shown = calibration.to_json()
    print(f"measured {nproc} ranks on {calibration.device} ({calibration.backend}):")
    for kind, rates in shown["copy_gb_per_s"].items():
        print(
            f"  copy {kind:<13} {rates['alone']:7.2f} GB/s alone, {rates['every_rank']:7.2f} GB/s each with every rank"
        )
    allreduce = shown["allreduce"]
    if allreduce is not None:
        print(
            f"  all-reduce    {allreduce['latency_s'] * 1e6:7.1f} us + bytes at "
            f"{allreduce['bus_gb_per_s']:.2f} GB/s (bus)"
        )
    if shown["p2p"] is not None:
        p2p = shown["p2p"]
        print(
            f"  send/receive  {p2p['latency_s'] * 1e6:7.1f} us + bytes at {p2p['gb_per_s']:.2f} GB/s"
        )
    print(f"  compute       {calibration.compute_slowdown:.2f}x slower with every rank computing")
    if calibration.stage_slowdown is not None:
        print(
            f"  compute       {calibration.stage_slowdown:.2f}x slower with one thread per rank, "
            "every rank at once"
        )
    if calibration.transfer_slowdown is not None:
        print(
            f"  compute       {calibration.transfer_slowdown:.2f}x slower with transfers going on "
            "(one thread, as a pipeline stage)"
        )
    print(f"wrote {out}")
    return 0


def _print(topology: Topology, *, as_json: bool) -> None:
    if as_json:
        print_json(topology.to_json())
    else:
        print(render_tree(topology), end="")
