"""What a simulation found (pipeswap.simresult/1): task times, GPU and link statistics."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pipeswap.jsonio import check_format, dump_json, load_json

__all__ = ["RESULT_FORMAT", "GpuStats", "LinkStats", "SimResult", "TaskTiming"]

RESULT_FORMAT = "pipeswap.simresult/1"


@dataclass(frozen=True)
class TaskTiming:
    """When a task started (head of its streams, deps done, memory granted) and ended."""

    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class GpuStats:
    """Compute-stream time of one GPU over ``[0, makespan]``.

    ``busy_s``: the compute stream runs a task. ``stall_s``: it runs nothing although its
    next compute task exists (waiting for deps or memory): the time from 0 to the end of
    its last compute task minus ``busy_s``. ``idle_s``: the rest (after its last compute
    task), so ``busy_s + stall_s + idle_s == makespan_s``. ``peak_bytes``: the largest
    memory in use (sum of alloc_bytes taken minus free_bytes returned).
    """

    busy_s: float
    stall_s: float
    peak_bytes: int
    idle_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "busy_s": self.busy_s,
            "stall_s": self.stall_s,
            "peak_bytes": self.peak_bytes,
            "idle_s": self.idle_s,
        }


@dataclass(frozen=True)
class LinkStats:
    """Bytes carried and time busy (at least one transfer) in each direction of a link."""

    a: str
    b: str
    bytes_ab: int
    bytes_ba: int
    busy_s_ab: float
    busy_s_ba: float

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "bytes_ab": self.bytes_ab,
            "bytes_ba": self.bytes_ba,
            "busy_s_ab": self.busy_s_ab,
            "busy_s_ba": self.busy_s_ba,
        }


@dataclass(frozen=True)
class SimResult:
    """The simulated run. ``link_rates`` (only when asked for) holds, per directed link
    ``(from, to)``, the total bytes/s at each change as ``(time_s, bytes_per_s)``."""

    makespan_s: float
    tasks: dict[str, TaskTiming]
    gpus: dict[str, GpuStats]
    links: list[LinkStats]
    link_rates: dict[tuple[str, str], list[tuple[float, float]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RESULT_FORMAT,
            "makespan_s": self.makespan_s,
            "tasks": {k: {"start_s": v.start_s, "end_s": v.end_s} for k, v in self.tasks.items()},
            "gpus": {k: v.to_json() for k, v in self.gpus.items()},
            "links": [link.to_json() for link in self.links],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "result") -> SimResult:
        check_format(obj, RESULT_FORMAT, where)
        return cls(
            makespan_s=float(obj["makespan_s"]),
            tasks={
                k: TaskTiming(float(v["start_s"]), float(v["end_s"]))
                for k, v in obj["tasks"].items()
            },
            gpus={
                k: GpuStats(
                    float(v["busy_s"]),
                    float(v["stall_s"]),
                    int(v["peak_bytes"]),
                    float(v.get("idle_s", 0.0)),
                )
                for k, v in obj["gpus"].items()
            },
            links=[
                LinkStats(
                    str(x["a"]),
                    str(x["b"]),
                    int(x["bytes_ab"]),
                    int(x["bytes_ba"]),
                    float(x["busy_s_ab"]),
                    float(x["busy_s_ba"]),
                )
                for x in obj["links"]
            ],
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SimResult:
        return cls.from_json(load_json(path), where=str(path))
