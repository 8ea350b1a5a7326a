"""Which FIFO streams of which GPUs a task occupies (compute, copy engines, comm)."""

from __future__ import annotations

from pipeswap.hardware.topology import Topology
from pipeswap.sim.graph import Task

__all__ = [
    "COMM",
    "COMPUTE",
    "COPY_D2H",
    "COPY_H2D",
    "COPY_SHARED",
    "STREAM_ORDER",
    "gpu_streams",
    "task_streams",
]

COMPUTE = "compute"
COPY_D2H = "d2h"
COPY_H2D = "h2d"
COPY_SHARED = "copy"  # the one copy engine of a GPU with copy_engines=1
COMM = "comm"

# Display order of a GPU's streams (trace threads, timeline rows).
STREAM_ORDER = (COMPUTE, COPY_H2D, COPY_D2H, COPY_SHARED, COMM)


def gpu_streams(topology: Topology, gpu: str) -> tuple[str, ...]:
    """The streams of ``gpu``: compute, its copy engine(s), comm."""
    if topology.node(gpu).copy_engines == 1:
        return (COMPUTE, COPY_SHARED, COMM)
    return (COMPUTE, COPY_H2D, COPY_D2H, COMM)


def task_streams(task: Task, topology: Topology) -> list[tuple[str, str]]:
    """The (gpu, stream) pairs ``task`` occupies from its start to its end.

    Compute runs on the compute stream; d2h and h2d on the copy engine of their direction
    (or the single shared one); p2p occupies the comm stream of both src and dst, as an
    NCCL send and its matching receive do; allreduce and barrier occupy every
    participant's comm stream. A rank that computes on the CPU (a node of spec ``"cpu"``,
    as ``pipeswap topology calibrate`` writes for CPU ranks) copies with the thread that
    computes: its d2h holds the compute stream too (pipeswap.streams: a CPU stream is a
    no-op), in graph order among its computes.
    """
    kind = task.kind
    if kind == "compute":
        return [(task.gpu, COMPUTE)]  # type: ignore[list-item]
    if kind in ("d2h", "h2d"):
        gpu: str = task.gpu  # type: ignore[assignment]
        node = topology.node(gpu)
        engine = COPY_SHARED if node.copy_engines == 1 else COPY_D2H if kind == "d2h" else COPY_H2D
        inline = kind == "d2h" and node.spec == "cpu"
        return [(gpu, COMPUTE), (gpu, engine)] if inline else [(gpu, engine)]
    return [(gpu, COMM) for gpu in task.participants]
