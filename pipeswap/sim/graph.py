"""The task graph contract (pipeswap.graph/1): what the simulator runs, checked and in JSON."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.json_fields import only_known
from pipeswap.jsonio import check_format, dump_json, load_json
from pipeswap.units import MAX_BYTES

__all__ = ["GRAPH_FORMAT", "TASK_KINDS", "Task", "TaskGraph"]

GRAPH_FORMAT = "pipeswap.graph/1"
TASK_KINDS = ("compute", "d2h", "h2d", "p2p", "allreduce", "barrier")
_GPU_KINDS = ("compute", "d2h", "h2d")
_GROUP_KINDS = ("allreduce", "barrier")


@dataclass(frozen=True)
class Task:
    """One unit of work on one stream (or, for collectives, on several GPUs' streams).

    - ``compute``: ``gpu`` is busy for ``duration_s``.
    - ``d2h`` / ``h2d``: ``bytes`` from ``gpu`` to its NUMA-local host memory, or back.
    - ``p2p``: ``bytes`` from GPU ``src`` to GPU ``dst``.
    - ``allreduce``: ring allreduce of ``bytes`` over ``gpus`` (ring order = list order).
    - ``barrier``: zero-length; starts once every GPU in ``gpus`` reaches it.

    ``alloc_bytes`` are taken when the task starts (it waits while they would not fit);
    ``free_bytes`` are returned when it ends. They apply to ``gpu`` when it is given; a
    p2p without ``gpu`` charges ``src``; an allreduce or barrier without ``gpu`` charges
    every GPU in ``gpus`` (each its own buffer).
    """

    id: str
    kind: str
    gpu: str | None = None
    gpus: tuple[str, ...] = ()
    src: str | None = None
    dst: str | None = None
    duration_s: float = 0.0
    bytes: int = 0
    deps: tuple[str, ...] = ()
    alloc_bytes: int = 0
    free_bytes: int = 0

    def __post_init__(self) -> None:
        _validate_task(self)

    @property
    def memory_gpus(self) -> tuple[str, ...]:
        """The GPUs whose memory ``alloc_bytes`` / ``free_bytes`` change."""
        if self.gpu is not None:
            return (self.gpu,)
        if self.kind == "p2p":
            return (self.src,) if self.src is not None else ()
        return self.gpus

    @property
    def participants(self) -> tuple[str, ...]:
        """Every GPU whose streams this task occupies."""
        if self.kind in _GPU_KINDS:
            return (self.gpu,) if self.gpu is not None else ()
        if self.kind == "p2p":
            return (self.src, self.dst)  # type: ignore[return-value]
        return self.gpus

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": self.id, "kind": self.kind}
        if self.gpu is not None:
            obj["gpu"] = self.gpu
        if self.gpus:
            obj["gpus"] = list(self.gpus)
        if self.src is not None:
            obj["src"] = self.src
            obj["dst"] = self.dst
        if self.kind == "compute":
            obj["duration_s"] = self.duration_s
        elif self.kind != "barrier":
            obj["bytes"] = self.bytes
        if self.deps:
            obj["deps"] = list(self.deps)
        if self.alloc_bytes:
            obj["alloc_bytes"] = self.alloc_bytes
        if self.free_bytes:
            obj["free_bytes"] = self.free_bytes
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "task") -> Task:
        """A task from its JSON object; wrong types and ranges are refused naming the field."""
        if not isinstance(obj, dict):
            raise PipeswapError(f"{where}: expected a JSON object, found {type(obj).__name__}")
        if "id" not in obj or "kind" not in obj:
            raise PipeswapError(f"{where}: every task needs an 'id' and a 'kind'")
        task_id = obj["id"]
        name = f"{where} {task_id!r}"
        only_known(obj, _TASK_KEYS, name)
        if not isinstance(task_id, str) or not task_id:
            raise PipeswapError(f"{name}: 'id' must be a non-empty string, found {task_id!r}")
        kind = obj["kind"]
        if not isinstance(kind, str):
            raise PipeswapError(
                f"{name}: 'kind' must be a string ({', '.join(TASK_KINDS)}), found {kind!r}"
            )
        return cls(
            id=task_id,
            kind=kind,
            gpu=_optional_name(obj, "gpu", name),
            gpus=_names(obj, "gpus", name, "GPU names"),
            src=_optional_name(obj, "src", name),
            dst=_optional_name(obj, "dst", name),
            duration_s=_seconds(obj.get("duration_s", 0.0), "duration_s", name),
            bytes=_whole(obj.get("bytes", 0), "bytes", name),
            deps=_names(obj, "deps", name, "task ids"),
            alloc_bytes=_whole(obj.get("alloc_bytes", 0), "alloc_bytes", name),
            free_bytes=_whole(obj.get("free_bytes", 0), "free_bytes", name),
        )


# A task's longest duration (about 30 years): longer ones are typing errors.
_LONGEST_TASK_S = 1e9

# The keys a task's JSON object may have (Task.to_json writes them).
_TASK_KEYS = (
    "id",
    "kind",
    "gpu",
    "gpus",
    "src",
    "dst",
    "duration_s",
    "bytes",
    "deps",
    "alloc_bytes",
    "free_bytes",
)


@dataclass(frozen=True)
class TaskGraph:
    """Tasks in the order their streams run them; ``deps`` name other tasks by id.

    Construction refuses duplicate ids, unknown deps and dependency cycles, naming the task.
    """

    tasks: tuple[Task, ...]
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        index: dict[str, int] = {}
        for position, task in enumerate(self.tasks):
            if task.id in index:
                raise PipeswapError(
                    f"task id {task.id!r} appears twice (positions {index[task.id]} and "
                    f"{position}); give every task a unique id"
                )
            index[task.id] = position
        for task in self.tasks:
            for dep in task.deps:
                if dep not in index:
                    raise PipeswapError(
                        f"task {task.id!r} depends on unknown task {dep!r}; "
                        "deps must name tasks of the same graph"
                    )
                if dep == task.id:
                    raise PipeswapError(f"task {task.id!r} depends on itself")
        object.__setattr__(self, "index", index)
        _refuse_cycles(self.tasks, index)

    def __len__(self) -> int:
        return len(self.tasks)

    def task(self, task_id: str) -> Task:
        try:
            return self.tasks[self.index[task_id]]
        except KeyError:
            raise PipeswapError(f"the graph has no task {task_id!r}") from None

    @property
    def gpus(self) -> list[str]:
        """Every GPU a task names, in order of first appearance."""
        seen: dict[str, None] = {}
        for task in self.tasks:
            for gpu in task.participants:
                seen.setdefault(gpu, None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        return {"format": GRAPH_FORMAT, "tasks": [t.to_json() for t in self.tasks]}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "graph") -> TaskGraph:
        if not isinstance(obj, dict):
            raise PipeswapError(
                f"{where}: expected a {GRAPH_FORMAT} JSON object, found {type(obj).__name__}"
            )
        check_format(obj, GRAPH_FORMAT, where)
        tasks = obj.get("tasks")
        if not isinstance(tasks, list):
            raise PipeswapError(f"{where}: 'tasks' must be a list of task objects")
        return cls(tuple(Task.from_json(t, f"{where}: task") for t in tasks))

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TaskGraph:
        return cls.from_json(load_json(path), where=str(path))


def _optional_name(obj: dict[str, Any], key: str, where: str) -> str | None:
    """A GPU name, or None when the key is absent or null."""
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise PipeswapError(f"{where}: {key!r} must be a GPU name (a string), found {value!r}")


def _names(obj: dict[str, Any], key: str, where: str, what: str) -> tuple[str, ...]:
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PipeswapError(
            f"{where}: {key!r} must be a list of {what} (non-empty strings), found {value!r}"
        )
    return tuple(value)


def _seconds(value: Any, key: str, where: str) -> float:
    # The range (finite, >= 0) is _validate_task's, for JSON and Python callers alike.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PipeswapError(f"{where}: {key} must be a number of seconds, found {value!r}")
    if isinstance(value, int) and value > 2**53:  # float() fails past ~1e308
        raise PipeswapError(f"{where}: {key} is {value} seconds; use a realistic duration")
    return float(value)


def _whole(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PipeswapError(f"{where}: {key} must be a number of bytes, found {value!r}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise PipeswapError(f"{where}: {key} must be a whole number of bytes, found {value!r}")
    if value > MAX_BYTES:  # negative values: _validate_task names them
        raise PipeswapError(f"{where}: {key} must be at most 2**63 - 1 bytes, found {value!r}")
    return int(value)


def _validate_task(task: Task) -> None:
    name = f"task {task.id!r}"
    if task.kind not in TASK_KINDS:
        raise PipeswapError(f"{name} has kind {task.kind!r}; use one of {', '.join(TASK_KINDS)}")
    for key in ("bytes", "alloc_bytes", "free_bytes"):
        if getattr(task, key) < 0:
            raise PipeswapError(f"{name} has negative {key} ({getattr(task, key)})")
        if getattr(task, key) > MAX_BYTES:
            raise PipeswapError(
                f"{name} has {key} {getattr(task, key)}, more than 2**63 - 1; check the size"
            )
    if not task.duration_s >= 0 or task.duration_s == float("inf"):
        raise PipeswapError(f"{name} has duration_s {task.duration_s}; use a finite value >= 0")
    if task.duration_s > _LONGEST_TASK_S:  # sums of such would overflow to inf, then NaN
        raise PipeswapError(
            f"{name} has duration_s {task.duration_s:g}; use at most {_LONGEST_TASK_S:g} s"
        )
    if task.kind in _GPU_KINDS:
        if not task.gpu:
            raise PipeswapError(f"{task.kind} {name} needs a 'gpu'")
    elif task.kind == "p2p":
        if not task.src or not task.dst:
            raise PipeswapError(f"p2p {name} needs 'src' and 'dst' GPUs")
        if task.src == task.dst:
            raise PipeswapError(f"p2p {name} sends from {task.src!r} to itself; drop the task")
        if task.gpu is not None and task.gpu not in (task.src, task.dst):
            raise PipeswapError(
                f"p2p {name} charges memory to {task.gpu!r}, which is neither src nor dst"
            )
    else:
        if not task.gpus:
            raise PipeswapError(f"{task.kind} {name} needs a non-empty 'gpus' list")
        if len(set(task.gpus)) != len(task.gpus):
            raise PipeswapError(f"{task.kind} {name} lists a GPU twice in 'gpus'")
        if task.gpu is not None and task.gpu not in task.gpus:
            raise PipeswapError(
                f"{task.kind} {name} charges memory to {task.gpu!r}, which is not in 'gpus'"
            )


def _refuse_cycles(tasks: Sequence[Task], index: dict[str, int]) -> None:
    # Kahn's algorithm; whatever is left over lies on or behind a cycle.
    pending = [len(t.deps) for t in tasks]
    dependents: list[list[int]] = [[] for _ in tasks]
    for position, task in enumerate(tasks):
        for dep in task.deps:
            dependents[index[dep]].append(position)
    ready = [i for i, n in enumerate(pending) if n == 0]
    done = 0
    while ready:
        here = ready.pop()
        done += 1
        for later in dependents[here]:
            pending[later] -= 1
            if pending[later] == 0:
                ready.append(later)
    if done == len(tasks):
        return
    # Walk back along unfinished deps until a task repeats: that loop is the cycle.
    start = next(i for i, n in enumerate(pending) if n > 0)
    seen: dict[int, int] = {}
    walk: list[int] = []
    here = start
    while here not in seen:
        seen[here] = len(walk)
        walk.append(here)
        here = next(index[d] for d in tasks[here].deps if pending[index[d]] > 0)
    cycle = [tasks[i].id for i in walk[seen[here] :]][::-1]
    raise PipeswapError(
        f"task {cycle[0]!r} is on a dependency cycle: {' -> '.join(cycle + [cycle[0]])}; "
        "remove one of these deps"
    )
