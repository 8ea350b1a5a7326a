"""Chrome traces (chrome://tracing, ui.perfetto.dev): one writer, and a simulated run's events."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pipeswap.hardware.topology import Topology
from pipeswap.jsonio import write_atomic
from pipeswap.sim.graph import Task, TaskGraph
from pipeswap.sim.result import SimResult
from pipeswap.sim.task_streams import STREAM_ORDER, gpu_streams, task_streams

__all__ = [
    "LINKS_PROCESS",
    "chrome_trace",
    "metadata_event",
    "simulation_events",
    "trace_document",
    "write_chrome_trace",
    "write_trace",
]

_US = 1e6  # trace timestamps are microseconds
LINKS_PROCESS = "links"


def trace_document(
    events: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The Chrome-trace JSON object of ``events``, with ``metadata`` as its ``otherData``."""
    trace: dict[str, Any] = {"traceEvents": list(events), "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = dict(metadata)
    return trace


def write_chrome_trace(
    path: str | os.PathLike[str],
    events: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Write :func:`trace_document` of ``events`` to ``path`` as compact JSON, atomically."""
    text = json.dumps(trace_document(events, metadata), separators=(",", ":"))
    write_atomic(path, text + "\n")


def metadata_event(name: str, pid: int, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """A "M" event: names or orders a process (``tid=None``) or one of its threads."""
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def chrome_trace(graph: TaskGraph, result: SimResult, topology: Topology) -> dict[str, Any]:
    """The trace: one process per GPU with a thread per stream, and "X" events for tasks.

    A last process, ``links``, holds a "C" counter per directed link ("gpu0->sw0") with its
    throughput in GB/s; it needs ``result.link_rates`` (``simulate(..., record_rates=True)``).
    """
    return trace_document(simulation_events(graph, result, topology), _metadata(result, topology))


def write_trace(
    path: str | os.PathLike[str], graph: TaskGraph, result: SimResult, topology: Topology
) -> None:
    """Write :func:`chrome_trace` as JSON to ``path``, atomically."""
    write_chrome_trace(
        path, simulation_events(graph, result, topology), _metadata(result, topology)
    )


def simulation_events(
    graph: TaskGraph, result: SimResult, topology: Topology
) -> list[dict[str, Any]]:
    """The events of :func:`chrome_trace`."""
    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    for pid, gpu in enumerate(topology.gpus, start=1):
        pids[gpu] = pid
        events.append(metadata_event("process_name", pid, None, {"name": gpu}))
        events.append(metadata_event("process_sort_index", pid, None, {"sort_index": pid}))
        for stream in gpu_streams(topology, gpu):
            tid = STREAM_ORDER.index(stream) + 1
            tids[(gpu, stream)] = tid
            events.append(metadata_event("thread_name", pid, tid, {"name": stream}))
            events.append(metadata_event("thread_sort_index", pid, tid, {"sort_index": tid}))
    for task in graph.tasks:
        timing = result.tasks[task.id]
        args = _task_args(task)
        for gpu, stream in task_streams(task, topology):
            events.append(
                {
                    "name": task.id,
                    "cat": task.kind,
                    "ph": "X",
                    "ts": timing.start_s * _US,
                    "dur": max(timing.end_s - timing.start_s, 0.0) * _US,
                    "pid": pids[gpu],
                    "tid": tids[(gpu, stream)],
                    "args": args,
                }
            )
    if result.link_rates:
        link_pid = len(pids) + 1
        events.append(metadata_event("process_name", link_pid, None, {"name": LINKS_PROCESS}))
        events.append(
            metadata_event("process_sort_index", link_pid, None, {"sort_index": link_pid})
        )
        for (src, dst), series in result.link_rates.items():
            for time_s, bytes_per_s in series:
                events.append(
                    {
                        "name": f"{src}->{dst}",
                        "ph": "C",
                        "ts": time_s * _US,
                        "pid": link_pid,
                        "tid": 0,
                        "args": {"GB/s": bytes_per_s / 1e9},
                    }
                )
    return events


def _metadata(result: SimResult, topology: Topology) -> dict[str, Any]:
    return {"topology": topology.name, "makespan_s": result.makespan_s}


def _task_args(task: Task) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for key in ("bytes", "alloc_bytes", "free_bytes"):
        if getattr(task, key):
            args[key] = getattr(task, key)
    if task.src is not None:
        args["src"], args["dst"] = task.src, task.dst
    if task.deps:
        args["deps"] = list(task.deps)
    return args
