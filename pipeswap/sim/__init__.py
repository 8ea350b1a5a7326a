"""Discrete-event simulation of task graphs on multi-GPU PCIe servers."""

from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.engine import DeadlockError, OutOfMemoryError, simulate
from pipeswap.sim.graph import Task, TaskGraph
from pipeswap.sim.result import GpuStats, LinkStats, SimResult, TaskTiming

__all__ = [
    "DeadlockError",
    "GpuStats",
    "GraphBuilder",
    "LinkStats",
    "OutOfMemoryError",
    "SimResult",
    "Task",
    "TaskGraph",
    "TaskTiming",
    "simulate",
]
