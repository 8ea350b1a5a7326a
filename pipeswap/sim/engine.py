"""Discrete-event simulation of a task graph on a PCIe topology: FIFO streams, fluid links."""

from __future__ import annotations

import heapq
import math

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import GB, Topology
from pipeswap.sim.collectives import (
    ring_allreduce_chunk_bytes,
    ring_allreduce_sends,
    ring_allreduce_steps,
)
from pipeswap.sim.flows import Flow, FlowNetwork, directed_path
from pipeswap.sim.graph import TaskGraph
from pipeswap.sim.result import GpuStats, LinkStats, SimResult, TaskTiming
from pipeswap.sim.task_streams import task_streams
from pipeswap.units import format_bytes

__all__ = [
    "DeadlockError",
    "GpuStats",
    "LinkStats",
    "OutOfMemoryError",
    "SimResult",
    "TaskTiming",
    "simulate",
]

_COMPUTE, _D2H, _H2D, _P2P, _ALLREDUCE, _BARRIER = range(6)
_KIND_CODES = {
    "compute": _COMPUTE,
    "d2h": _D2H,
    "h2d": _H2D,
    "p2p": _P2P,
    "allreduce": _ALLREDUCE,
    "barrier": _BARRIER,
}


class OutOfMemoryError(ConfigError):
    """An allocation that can never fit: nothing running or pending can free memory."""

    def __init__(self, gpu: str, task: str, asked: int, in_use: int, limit: int) -> None:
        self.gpu, self.task, self.asked, self.in_use, self.limit = gpu, task, asked, in_use, limit
        super().__init__(
            f"{gpu} is out of memory: task {task!r} asks for {asked} bytes "
            f"({format_bytes(asked)}) while {in_use} bytes ({format_bytes(in_use)}) are in use "
            f"and the limit is {limit} bytes ({format_bytes(limit)}); nothing running or "
            f"pending can free memory. Raise the limit ({{gpu_memory_bytes}}) or free memory "
            f"(free_bytes) in a task that can end before {task!r} starts"
        )


class DeadlockError(PipeswapError):
    """No task can start although some have not run: stream order contradicts deps."""


def simulate(
    graph: TaskGraph,
    topology: Topology,
    *,
    gpu_memory_bytes: int | None = None,
    record_rates: bool = False,
) -> SimResult:
    """Run ``graph`` on ``topology`` and return every task's times and the resource use.

    A GPU's memory limit is ``gpu_memory_bytes`` if given, else its node's
    ``memory_bytes``; 0 means unlimited. ``record_rates`` keeps each directed link's
    throughput over time in ``SimResult.link_rates`` (for traces and timelines).
    Raises OutOfMemoryError, DeadlockError, or PipeswapError for a task on an unknown GPU.
    """
    return _Simulation(graph, topology, gpu_memory_bytes, record_rates).run()


def _collective_times(topology: Topology) -> dict[int, tuple[float, float]]:
    """(latency s, bytes/s) of the all-reduce and p2p a calibrated topology measured."""
    calibration = topology.calibration or {}
    found: dict[int, tuple[float, float]] = {}
    allreduce, p2p = calibration.get("allreduce"), calibration.get("p2p")
    if allreduce:
        found[_ALLREDUCE] = (float(allreduce["latency_s"]), float(allreduce["bus_gb_per_s"]) * GB)
    if p2p:
        found[_P2P] = (float(p2p["latency_s"]), float(p2p["gb_per_s"]) * GB)
    return found


class _Simulation:
    """The state of one run; tasks, GPUs and streams are integers for speed."""

    def __init__(
        self, graph: TaskGraph, topology: Topology, gpu_memory_bytes: int | None, record_rates: bool
    ) -> None:
        self.graph, self.topology = graph, topology
        gpu_names = topology.gpus
        gpu_index = {g: i for i, g in enumerate(gpu_names)}
        self.gpu_names = gpu_names
        limits = []
        for g in gpu_names:
            memory = topology.node(g).memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
            limits.append(memory if memory > 0 else math.inf)
        self.limit = limits
        self.used = [0] * len(gpu_names)
        self.peak = [0] * len(gpu_names)
        self.busy = [0.0] * len(gpu_names)
        self.last_compute_end = [0.0] * len(gpu_names)
        self.mem_blocked: list[set[int]] = [set() for _ in gpu_names]
        self.net = FlowNetwork(topology, record_rates=record_rates)
        # A measured machine's collectives take their measured time (latency + bytes at
        # the fitted rate) instead of flows on its links: gloo's all-reduce is not the
        # links' memory copies (pipeswap.hardware.calibration).
        self.timed_collectives = _collective_times(topology)

        stream_ids: dict[tuple[str, str], int] = {}
        self.queue_tasks: list[list[int]] = []
        tasks = graph.tasks
        count = len(tasks)
        self.kind = [0] * count
        self.queues: list[tuple[int, ...]] = [()] * count
        self.memory_gpus: list[tuple[int, ...]] = [()] * count
        self.flow_paths: list[tuple[tuple[int, ...], ...]] = [()] * count
        self.gpu_of = [-1] * count
        self.deps_left = [len(t.deps) for t in tasks]
        self.dependents: list[list[int]] = [[] for _ in tasks]
        hosts = {g: topology.host_of(g) for g in gpu_names}
        paths: dict[tuple[str, str], tuple[int, ...]] = {}

        def path(src: str, dst: str) -> tuple[int, ...]:
            key = (src, dst)
            if key not in paths:
                paths[key] = directed_path(topology, src, dst)
            return paths[key]

        for i, task in enumerate(tasks):
            for gpu in task.participants:
                if gpu not in gpu_index:
                    raise PipeswapError(
                        f"task {task.id!r} runs on {gpu!r}, which is not a GPU of topology "
                        f"{topology.name!r}; its GPUs: {', '.join(gpu_names)}"
                    )
            code = _KIND_CODES[task.kind]
            self.kind[i] = code
            queue_ids = []
            for key in task_streams(task, topology):
                if key not in stream_ids:
                    stream_ids[key] = len(self.queue_tasks)
                    self.queue_tasks.append([])
                queue_ids.append(stream_ids[key])
                self.queue_tasks[stream_ids[key]].append(i)
            self.queues[i] = tuple(queue_ids)
            self.memory_gpus[i] = tuple(gpu_index[g] for g in task.memory_gpus)
            if task.gpu is not None:
                self.gpu_of[i] = gpu_index[task.gpu]
            if code in (_D2H, _H2D):
                copier = task.gpu
                assert copier is not None  # the graph's validation gives every copy a GPU
                ends = (copier, hosts[copier]) if code == _D2H else (hosts[copier], copier)
                self.flow_paths[i] = (path(*ends),)
            elif code == _P2P:
                self.flow_paths[i] = (path(task.src, task.dst),)  # type: ignore[arg-type]
            elif code == _ALLREDUCE:
                self.flow_paths[i] = tuple(path(s, d) for s, d in ring_allreduce_sends(task.gpus))
            for dep in task.deps:
                self.dependents[graph.index[dep]].append(i)
        self.stream_names = {qid: key for key, qid in stream_ids.items()}
        self.head = [0] * len(self.queue_tasks)
        self.started = [False] * count
        self.start_s = [0.0] * count
        self.end_s = [0.0] * count
        self.done = 0
        self.ring_step = [0] * count
        self.ring_left = [0] * count
        self.heap: list[tuple] = []
        self.seq = 0

    # ---- the event loop -------------------------------------------------------------
    def run(self) -> SimResult:
        heap = self.heap
        pop = heapq.heappop
        t = 0.0
        self._try_start({q[0] for q in self.queue_tasks}, t)
        self._settle(t)
        while heap:
            t = heap[0][0]
            candidates: set[int] = set()
            while heap and heap[0][0] == t:
                event = pop(heap)
                flow = event[3]
                if flow is None:
                    self._end_task(event[2], t, candidates)
                elif flow.version == event[4]:
                    self._end_flow(flow, t, candidates)
            if candidates:
                self._try_start(candidates, t)
            self._settle(t)
        if self.done < len(self.graph.tasks):
            self._explain_stuck(t)
        return self._result()

    def _push(self, time: float, task: int, flow: Flow | None = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, task, flow, flow.version if flow else 0))

    def _settle(self, t: float) -> None:
        for flow in self.net.settle(t):
            self._push(flow.end, flow.owner, flow)

    def _try_start(self, candidates: set[int], t: float) -> None:
        # Graph order decides who gets memory first when several tasks become ready at once.
        for i in sorted(candidates):
            if self.started[i] or self.deps_left[i]:
                continue
            if any(self.queue_tasks[q][self.head[q]] != i for q in self.queues[i]):
                continue
            if not self._allocate(i):
                continue
            self._start(i, t)

    def _allocate(self, i: int) -> bool:
        alloc = self.graph.tasks[i].alloc_bytes
        gpus = self.memory_gpus[i]
        if alloc:
            for g in gpus:
                if self.used[g] + alloc > self.limit[g]:
                    self.mem_blocked[g].add(i)
                    return False
            for g in gpus:
                self.used[g] += alloc
                if self.used[g] > self.peak[g]:
                    self.peak[g] = self.used[g]
        for g in gpus:
            self.mem_blocked[g].discard(i)
        return True

    def _start(self, i: int, t: float) -> None:
        self.started[i] = True
        self.start_s[i] = t
        task = self.graph.tasks[i]
        code = self.kind[i]
        if code == _COMPUTE:
            self.busy[self.gpu_of[i]] += task.duration_s
            self._push(t + task.duration_s, i)
        elif code == _BARRIER or task.bytes == 0:
            self._push(t, i)
        elif code in self.timed_collectives and (code != _ALLREDUCE or len(task.gpus) > 1):
            latency, bytes_per_s = self.timed_collectives[code]
            n = len(task.gpus)
            bus = 2 * (n - 1) / n if code == _ALLREDUCE else 1.0
            self._push(t + latency + task.bytes * bus / bytes_per_s, i)
        elif code == _ALLREDUCE:
            if len(task.gpus) == 1:
                self._push(t, i)
            else:
                self.ring_step[i] = 0
                self._start_ring_step(i, t)
        else:
            self.net.start(Flow(self.flow_paths[i][0], float(task.bytes), i), t)

    def _start_ring_step(self, i: int, t: float) -> None:
        task = self.graph.tasks[i]
        chunk = ring_allreduce_chunk_bytes(task.bytes, task.gpus)
        sends = self.flow_paths[i]
        self.ring_left[i] = len(sends)
        for links in sends:
            self.net.start(Flow(links, chunk, i), t)

    def _end_flow(self, flow: Flow, t: float, candidates: set[int]) -> None:
        self.net.finish(flow, t)
        i = flow.owner
        if self.kind[i] == _ALLREDUCE:
            self.ring_left[i] -= 1
            if self.ring_left[i]:
                return
            self.ring_step[i] += 1
            if self.ring_step[i] < ring_allreduce_steps(self.graph.tasks[i].gpus):
                self._start_ring_step(i, t)
                return
        self._end_task(i, t, candidates)

    def _end_task(self, i: int, t: float, candidates: set[int]) -> None:
        self.end_s[i] = t
        self.done += 1
        if self.kind[i] == _COMPUTE:
            self.last_compute_end[self.gpu_of[i]] = t
        task = self.graph.tasks[i]
        if task.free_bytes:
            for g in self.memory_gpus[i]:
                self.used[g] -= task.free_bytes
                if self.used[g] < 0:
                    raise PipeswapError(
                        f"task {task.id!r} frees {task.free_bytes} bytes on "
                        f"{self.gpu_names[g]} but only {self.used[g] + task.free_bytes} are in "
                        "use; free only what earlier tasks allocated (add deps so the "
                        "allocation happens first)"
                    )
                candidates.update(self.mem_blocked[g])
        for q in self.queues[i]:
            position = self.head[q] + 1
            self.head[q] = position
            queue = self.queue_tasks[q]
            if position < len(queue):
                candidates.add(queue[position])
            else:
                queue.append(-1)  # sentinel: an exhausted queue has no head task
        for j in self.dependents[i]:
            self.deps_left[j] -= 1
            if not self.deps_left[j]:
                candidates.add(j)

    # ---- failure reports ------------------------------------------------------------
    def _explain_stuck(self, t: float) -> None:
        tasks = self.graph.tasks
        blocked = sorted(i for group in self.mem_blocked for i in group)
        if blocked:
            i = blocked[0]
            alloc = tasks[i].alloc_bytes
            for g in self.memory_gpus[i]:
                if self.used[g] + alloc > self.limit[g]:
                    raise OutOfMemoryError(
                        self.gpu_names[g], tasks[i].id, alloc, self.used[g], int(self.limit[g])
                    )
        first = next(i for i in range(len(tasks)) if not self.started[i])
        waits = [d for d in tasks[first].deps if not self.started[self.graph.index[d]]]
        reasons = []
        for dep in waits[:3]:
            j = self.graph.index[dep]
            for q in self.queues[j]:
                head = self.queue_tasks[q][self.head[q]]
                if head != j:
                    gpu, stream = self.stream_names[q]
                    reasons.append(f"{dep!r} is queued behind {tasks[head].id!r} on {gpu} {stream}")
                    break
        raise DeadlockError(
            f"deadlock at t={t:.6g} s: task {tasks[first].id!r} waits for "
            f"{', '.join(repr(d) for d in waits)}"
            + (f", and {'; '.join(reasons)}" if reasons else "")
            + ". Each stream runs its tasks in graph order: list every task after the tasks it "
            "depends on"
        )

    def _result(self) -> SimResult:
        tasks = self.graph.tasks
        makespan = max(self.end_s, default=0.0)
        gpus = {}
        for g, name in enumerate(self.gpu_names):
            last = self.last_compute_end[g]
            gpus[name] = GpuStats(
                busy_s=self.busy[g],
                stall_s=max(last - self.busy[g], 0.0),
                peak_bytes=self.peak[g],
                idle_s=max(makespan - last, 0.0),
            )
        net = self.net
        links = [
            LinkStats(
                link.a,
                link.b,
                round(net.bytes[2 * u]),
                round(net.bytes[2 * u + 1]),
                net.busy_s[2 * u],
                net.busy_s[2 * u + 1],
            )
            for u, link in enumerate(self.topology.links)
        ]
        rates: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for dl, series in enumerate(net.rates):
            if series:
                link = self.topology.links[dl >> 1]
                rates[(link.a, link.b) if dl % 2 == 0 else (link.b, link.a)] = series
        timings = {t.id: TaskTiming(self.start_s[i], self.end_s[i]) for i, t in enumerate(tasks)}
        return SimResult(makespan, timings, gpus, links, rates)
