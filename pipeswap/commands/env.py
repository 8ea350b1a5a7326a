"""`pipeswap env`: versions, CUDA and collectives backends, GPUs seen, detected topology."""

from __future__ import annotations

import argparse
import platform
from typing import Any

import torch
import torch.distributed as dist

import pipeswap
from pipeswap.commands.json_out import print_json
from pipeswap.commands.options import add_options
from pipeswap.commands.settings import Outputs

__all__ = ["environment", "format_environment", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "env",
        help="show versions, CUDA, NCCL/gloo, the GPUs seen and the detected topology",
        description="Describe this machine as pipeswap sees it (paste it into bug reports).",
    )
    add_options(parser, Outputs, only=("json",), helps={"json": "print one JSON object"})
    parser.set_defaults(func=run)


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name, "memory_bytes": props.total_memory})
    return found


def _topology() -> tuple[dict[str, Any] | None, str | None]:
    """The detected topology as JSON (None if none), and why detection failed, if it did."""
    try:
        from pipeswap.hardware import detect
    except ImportError:
        return None, None
    try:
        topology = detect.detect_topology()
    except Exception as exc:  # a diagnostic command reports a broken driver, never dies of it
        return None, f"{type(exc).__name__}: {exc}"
    return (None if topology is None else topology.to_json()), None


def environment() -> dict[str, Any]:
    """Everything `pipeswap env` reports, as a JSON-ready dict."""
    cuda = torch.cuda.is_available()
    topology, topology_error = _topology()
    info: dict[str, Any] = {
        "pipeswap": pipeswap.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda if cuda else None,
        "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
        "gloo_available": bool(dist.is_available() and dist.is_gloo_available()),
        "gpus": _gpus(),
        "topology": topology,
    }
    if topology_error is not None:
        info["topology_error"] = topology_error
    return info


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_environment(info: dict[str, Any]) -> str:
    lines = [
        f"pipeswap        {info['pipeswap']}",
        f"python          {info['python']}",
        f"torch           {info['torch']}",
        "cuda available  "
        + (f"yes (CUDA {info['cuda_version']})" if info["cuda_available"] else "no"),
        f"nccl available  {_yes(info['nccl_available'])}",
        f"gloo available  {_yes(info['gloo_available'])}",
    ]
    if info["gpus"]:
        lines.append(f"gpus            {len(info['gpus'])}")
        for gpu in info["gpus"]:
            lines.append(
                f"  cuda:{gpu['index']}  {gpu['name']}  {gpu['memory_bytes'] / 2**30:.1f} GiB"
            )
    else:
        lines.append("gpus            none")
    topology = info["topology"]
    if topology is None:
        why = f" (detection failed: {info['topology_error']})" if "topology_error" in info else ""
        lines.append(f"topology        none detected{why}")
    else:
        kinds = [node["kind"] for node in topology["nodes"]]
        lines.append(
            f"topology        {topology['name']}: {kinds.count('gpu')} GPUs, "
            f"{kinds.count('switch')} switches, {kinds.count('cpu')} CPUs, "
            f"{len(topology['links'])} links"
        )
        for link in topology["links"]:
            lines.append(f"  {link['a']} -- {link['b']}  {link['gb_per_s']:g} GB/s per direction")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    info = environment()
    if args.json:
        print_json(info)
    else:
        print(format_environment(info))
    return 0
