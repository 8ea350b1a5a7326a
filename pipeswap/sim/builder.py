"""GraphBuilder: a task graph appended task by task in stream order, for planners."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypedDict, Unpack

from pipeswap.errors import PipeswapError
from pipeswap.sim.graph import Task, TaskGraph

__all__ = ["GraphBuilder", "TaskOptions"]


class TaskOptions(TypedDict, total=False):
    """What every kind of task takes beside its own fields, all by keyword: the tasks it
    waits for, the bytes it allocates and frees on its GPU, and its id (default: kind and
    position)."""

    deps: Iterable[str]
    alloc_bytes: int
    free_bytes: int
    id: str | None


class GraphBuilder:
    """Appends tasks in stream order and returns their ids, for planners.

    >>> b = GraphBuilder()
    >>> f = b.compute("gpu0", 0.5, alloc_bytes=10)
    >>> out = b.d2h("gpu0", 10, deps=[f], free_bytes=10)
    >>> graph = b.build()
    """

    def __init__(self) -> None:
        self._tasks: list[Task] = []
        self._ids: set[str] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, task: Task) -> str:
        if task.id in self._ids:
            raise PipeswapError(f"task id {task.id!r} is already in the graph")
        self._ids.add(task.id)
        self._tasks.append(task)
        return task.id

    def _next_id(self, kind: str, given: str | None) -> str:
        if given is not None:
            return given
        candidate = f"{kind}{len(self._tasks)}"
        while candidate in self._ids:
            candidate += "_"
        return candidate

    def compute(self, gpu: str, duration_s: float, **task: Unpack[TaskOptions]) -> str:
        return self._task("compute", task, gpu=gpu, duration_s=duration_s)

    def d2h(self, gpu: str, nbytes: int, **task: Unpack[TaskOptions]) -> str:
        return self._task("d2h", task, gpu=gpu, bytes=nbytes)

    def h2d(self, gpu: str, nbytes: int, **task: Unpack[TaskOptions]) -> str:
        return self._task("h2d", task, gpu=gpu, bytes=nbytes)

    def p2p(
        self,
        src: str,
        dst: str,
        nbytes: int,
        *,
        gpu: str | None = None,
        **task: Unpack[TaskOptions],
    ) -> str:
        return self._task("p2p", task, src=src, dst=dst, bytes=nbytes, gpu=gpu)

    def allreduce(self, gpus: Sequence[str], nbytes: int, **task: Unpack[TaskOptions]) -> str:
        return self._task("allreduce", task, gpus=tuple(gpus), bytes=nbytes)

    def barrier(
        self, gpus: Sequence[str], *, deps: Iterable[str] = (), id: str | None = None
    ) -> str:
        return self._task("barrier", {"deps": deps, "id": id}, gpus=tuple(gpus))

    def _task(self, kind: str, task: TaskOptions, **fields: Any) -> str:
        task_id = self._next_id(kind, task.get("id"))
        return self.add(
            Task(
                task_id,
                kind,
                deps=tuple(task.get("deps", ())),
                alloc_bytes=task.get("alloc_bytes", 0),
                free_bytes=task.get("free_bytes", 0),
                **fields,
            )
        )

    def build(self) -> TaskGraph:
        return TaskGraph(tuple(self._tasks))
