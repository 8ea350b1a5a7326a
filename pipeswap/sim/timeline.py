"""A simulated run as a PNG Gantt chart: a row per GPU stream and per busy directed link."""

from __future__ import annotations

import io
import os

import matplotlib

from pipeswap.hardware.topology import Topology
from pipeswap.jsonio import write_atomic
from pipeswap.sim.graph import TASK_KINDS, TaskGraph
from pipeswap.sim.result import SimResult
from pipeswap.sim.task_streams import gpu_streams, task_streams

__all__ = ["KIND_COLORS", "LINK_COLOR", "plot_timeline"]

matplotlib.use("Agg")  # files only; never open a window; before pyplot is imported

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

KIND_COLORS = {
    "compute": "#4c72b0",
    "d2h": "#dd8452",
    "h2d": "#55a868",
    "p2p": "#8172b3",
    "allreduce": "#c44e52",
    "barrier": "#222222",
}
LINK_COLOR = "#937860"


def plot_timeline(
    path: str | os.PathLike[str],
    graph: TaskGraph,
    result: SimResult,
    topology: Topology,
    *,
    title: str | None = None,
) -> list[str]:
    """Draw the Gantt chart to ``path`` (PNG).

    Task bars are coloured by kind; barriers (zero length) are thin ticks. Each busy
    directed link gets a row filled to its throughput as a fraction of its bandwidth
    (a full row = the link's ``gb_per_s``); it needs ``result.link_rates``. Returns the
    row labels, top to bottom.
    """
    rows: list[str] = []
    row_of: dict[tuple[str, str], int] = {}
    used = {key for task in graph.tasks for key in task_streams(task, topology)}
    for gpu in topology.gpus:
        for stream in gpu_streams(topology, gpu):
            if (gpu, stream) in used:
                row_of[(gpu, stream)] = len(rows)
                rows.append(f"{gpu} {stream}")
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    ticks: dict[int, list[float]] = {}
    for task in graph.tasks:
        timing = result.tasks[task.id]
        for key in task_streams(task, topology):
            if task.kind == "barrier" or timing.end_s == timing.start_s:
                ticks.setdefault(row_of[key], []).append(timing.start_s)
            else:
                bars.setdefault((row_of[key], task.kind), []).append(
                    (timing.start_s, timing.end_s - timing.start_s)
                )
    capacity = {}
    for link in topology.links:
        capacity[(link.a, link.b)] = capacity[(link.b, link.a)] = link.bytes_per_s
    link_rows = []
    for link in topology.links:
        for pair in ((link.a, link.b), (link.b, link.a)):
            series = result.link_rates.get(pair, [])
            if any(rate > 0 for _, rate in series):
                link_rows.append((pair, series))

    height = 0.8
    total_rows = len(rows) + len(link_rows)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.32 * max(total_rows, 1)))
    for (row, kind), spans in bars.items():
        ax.broken_barh(
            spans,
            (row - height / 2, height),
            facecolors=KIND_COLORS[kind],
            edgecolor="white",
            linewidth=0.3,
        )
    for row, times in ticks.items():
        ax.vlines(
            times, row - height / 2, row + height / 2, colors=KIND_COLORS["barrier"], linewidth=1.0
        )
    for (src, dst), series in link_rows:
        row = len(rows)
        rows.append(f"{src}\u2192{dst}")
        times = [t for t, _ in series] + [result.makespan_s]
        fractions = [rate / capacity[(src, dst)] for _, rate in series]
        fractions.append(fractions[-1])
        base = row + height / 2  # rows grow downwards (inverted axis): fill upwards from base
        ax.broken_barh(
            [(0, result.makespan_s)], (row - height / 2, height), facecolors="#f0ebe6", linewidth=0
        )
        ax.fill_between(
            times,
            base,
            [base - height * f for f in fractions],
            step="post",
            color=LINK_COLOR,
            linewidth=0,
        )
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max(result.makespan_s, 1e-9))
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    present = {kind for _, kind in bars} | ({"barrier"} if ticks else set())
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in TASK_KINDS if k in present]
    if link_rows:
        handles.append(Patch(color=LINK_COLOR, label="link throughput / bandwidth"))
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )
    ax.set_title(title or f"{topology.name}: makespan {result.makespan_s:.4g} s", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return rows
