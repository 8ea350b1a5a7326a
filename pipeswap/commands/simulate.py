"""`pipeswap simulate`: run a task graph on a topology; print times, write traces and charts."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeswap.commands.json_out import print_json
from pipeswap.commands.options import add_options, given
from pipeswap.commands.settings import Outputs, SimulateOptions
from pipeswap.errors import PipeswapError
from pipeswap.hardware.detect import named_topology
from pipeswap.hardware.presets import topology_file
from pipeswap.hardware.topology import Topology
from pipeswap.jsonio import check_writable
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import TaskGraph
from pipeswap.sim.result import SimResult
from pipeswap.sim.trace import write_trace
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.units import format_bytes

__all__ = ["EXAMPLES", "register", "run", "summary", "write_views"]

EXAMPLES = """examples:
  pipeswap simulate --graph plan.graph.json --topology dual-root-8
  pipeswap simulate --graph g.json --topology switch-4:gen4 --gpu-memory 16GiB --json
  pipeswap simulate --graph g.json --topology my-server.json --trace run.trace.json \\
      --timeline run.png      # open the trace in ui.perfetto.dev or chrome://tracing
"""


_HELPS = {
    "topology": "a preset (switch-4, single-root-8, dual-root-8, direct-4; append "
    ":gen4/:gen5), a topology JSON file, or detect (this machine's GPUs)",
    "gpu_memory_bytes": "every GPU's memory limit, e.g. 16GiB, 16GB, 512MiB, 1.5e9 (default: "
    "the topology's memory_bytes; 0 = unlimited)",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a task graph (pipeswap.graph/1) on a PCIe topology",
        description="Simulate a task graph on a multi-GPU PCIe server: FIFO streams per GPU, "
        "transfers sharing links max-min fairly, memory limits. Prints the makespan and "
        "per-GPU and per-link use.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, SimulateOptions, required=("graph",))
    add_options(parser, TrainConfig, only=("topology",), required=("topology",), helps=_HELPS)
    add_options(parser, SwapConfig, only=("gpu_memory_bytes",), helps=_HELPS)
    add_options(parser, Outputs, only=("json", "trace", "timeline"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    graph = TaskGraph.load(args.graph)
    topology = named_topology(args.topology)
    topology.require_gpus(args.topology)
    memory = given(args, SwapConfig).get("gpu_memory_bytes")
    wants_rates = args.trace is not None or args.timeline is not None
    result = simulate(graph, topology, gpu_memory_bytes=memory, record_rates=wants_rates)
    # With --json, stdout carries the JSON alone; notes about written files go to stderr.
    notes = sys.stderr if args.json else sys.stdout
    if args.json:
        print_json(result.to_json())
    else:
        print(summary(result, topology.name, len(graph)))
    write_views(args, graph, result, topology, notes)
    return 0


def write_views(
    args: argparse.Namespace, graph: TaskGraph, result: SimResult, topology: Topology, notes: Any
) -> None:
    """The --trace and --timeline of a simulated graph, when asked for (``simulate``, and
    ``plan`` for the graph it chose)."""
    if args.trace is not None:
        write_trace(args.trace, graph, result, topology)
        print(f"wrote trace {args.trace} (open in ui.perfetto.dev or chrome://tracing)", file=notes)
    if args.timeline is not None:
        # matplotlib loads only when a timeline is asked for.
        from pipeswap.sim.timeline import plot_timeline

        plot_timeline(args.timeline, graph, result, topology)
        print(f"wrote timeline {args.timeline}", file=notes)


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before simulating, an output that cannot be written, that would overwrite the
    graph or topology file, or that is given twice."""

    inputs = (args.graph, topology_file(args.topology))
    for flag, path, others in (
        ("--trace", args.trace, [args.timeline]),
        ("--timeline", args.timeline, []),
    ):
        if path == "":
            raise PipeswapError(f"{flag} is empty; give a file name")
        if path is not None:
            check_writable(path, inputs=inputs, outputs=others)


def summary(result: SimResult, topology_name: str, task_count: int) -> str:
    """The human report: makespan, per-GPU compute use and memory, per busy link direction."""
    makespan = result.makespan_s
    lines = [f"topology {topology_name}, {task_count} tasks, makespan {makespan:.6g} s", ""]
    lines.append(f"{'gpu':<8}{'busy s':>12}{'stall s':>12}{'idle s':>12}{'peak memory':>14}")
    for gpu, stats in result.gpus.items():
        lines.append(
            f"{gpu:<8}{stats.busy_s:>12.4f}{stats.stall_s:>12.4f}{stats.idle_s:>12.4f}"
            f"{format_bytes(stats.peak_bytes):>14}"
        )
    rows = []
    for link in result.links:
        for src, dst, nbytes, busy in (
            (link.a, link.b, link.bytes_ab, link.busy_s_ab),
            (link.b, link.a, link.bytes_ba, link.busy_s_ba),
        ):
            if nbytes:
                share = 100 * busy / makespan if makespan > 0 else 0.0
                rows.append(
                    f"{src + ' -> ' + dst:<22}{format_bytes(nbytes):>12}{busy:>12.4f}{share:>9.1f}%"
                )
    lines.append("")
    if rows:
        lines.append(f"{'link':<22}{'bytes':>12}{'busy s':>12}{'busy':>10}")
        lines.extend(rows)
    else:
        lines.append("no link carried traffic")
    return "\n".join(lines)
