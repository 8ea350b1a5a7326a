"""GraphBuilder: a task graph appended task by task in stream order, for planners."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.sim.graph import Task, TaskGraph

__all__ = ["GraphBuilder"]


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

    def compute(
        self,
        gpu: str,
        duration_s: float,
        *,
        deps: Iterable[str] = (),
        alloc_bytes: int = 0,
        free_bytes: int = 0,
        id: str | None = None,
    ) -> str:
        memory = {"alloc_bytes": alloc_bytes, "free_bytes": free_bytes}
        return self._task("compute", id, deps, gpu=gpu, duration_s=duration_s, **memory)

    def d2h(
        self,
        gpu: str,
        nbytes: int,
        *,
        deps: Iterable[str] = (),
        alloc_bytes: int = 0,
        free_bytes: int = 0,
        id: str | None = None,
    ) -> str:
        memory = {"alloc_bytes": alloc_bytes, "free_bytes": free_bytes}
        return self._task("d2h", id, deps, gpu=gpu, bytes=nbytes, **memory)

    def h2d(
        self,
        gpu: str,
        nbytes: int,
        *,
        deps: Iterable[str] = (),
        alloc_bytes: int = 0,
        free_bytes: int = 0,
        id: str | None = None,
    ) -> str:
        memory = {"alloc_bytes": alloc_bytes, "free_bytes": free_bytes}
        return self._task("h2d", id, deps, gpu=gpu, bytes=nbytes, **memory)

    def p2p(
        self,
        src: str,
        dst: str,
        nbytes: int,
        *,
        deps: Iterable[str] = (),
        alloc_bytes: int = 0,
        free_bytes: int = 0,
        gpu: str | None = None,
        id: str | None = None,
    ) -> str:
        memory = {"alloc_bytes": alloc_bytes, "free_bytes": free_bytes}
        return self._task("p2p", id, deps, src=src, dst=dst, bytes=nbytes, gpu=gpu, **memory)

    def allreduce(
        self,
        gpus: Sequence[str],
        nbytes: int,
        *,
        deps: Iterable[str] = (),
        alloc_bytes: int = 0,
        free_bytes: int = 0,
        id: str | None = None,
    ) -> str:
        memory = {"alloc_bytes": alloc_bytes, "free_bytes": free_bytes}
        return self._task("allreduce", id, deps, gpus=tuple(gpus), bytes=nbytes, **memory)

    def barrier(
        self, gpus: Sequence[str], *, deps: Iterable[str] = (), id: str | None = None
    ) -> str:
        return self._task("barrier", id, deps, gpus=tuple(gpus))

    def _task(self, kind: str, id: str | None, deps: Iterable[str], **fields: Any) -> str:
        return self.add(Task(self._next_id(kind, id), kind, deps=tuple(deps), **fields))

    def build(self) -> TaskGraph:
        return TaskGraph(tuple(self._tasks))
