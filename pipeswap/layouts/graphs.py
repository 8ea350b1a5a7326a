"""The task graph of D replicas of a K-stage pipeline whose stages may swap (pipeswap.graph/1).

Stage k of replica r runs on ``placement[r][k]``. Every F/B/UPDATE is a compute task
after the previous one of its GPU, every SEND a p2p, as
:func:`pipeswap.schedule.taskgraph.pipeline_task_graph` builds them; on top of that:

- **stage swapping** (a :class:`StagePlan` per stage): after a unit's forward a d2h
  takes its swapped bytes to host (freeing them); an h2d brings them back (allocating
  them) once the plan's ``lead``-th compute action before the unit's backward has
  ended, and the backward waits for it; a recompute task (the recomputed layers'
  forward again, allocating what they save) runs right before the backward.
- **data parallelism** (D > 1): a stage's gradients are all-reduced over its replicas'
  GPUs in DDP's buckets (``bucket_bytes``, filled from the stage's last layer down):
  the last backward of each mini-batch is cut where a bucket is complete, and each
  bucket's all-reduce starts once that part has run on every replica, overlapping the
  rest of the backward and the other stages' work; the stage's UPDATE waits for all.

Memory: a ``init`` task holds each stage's resident bytes; a forward allocates the
unit's saved tensors and the stage's working set, the backward frees them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeswap.errors import PipeswapError
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import Schedule, unit_time_order
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.graph import TaskGraph
from pipeswap.swap.plan.iteration import Bucket, buckets_of
from pipeswap.swap.plan.stage_costs import StageCosts
from pipeswap.swap.plan.stage_swap import (
    NO_PLAN,
    StagePlan,
    UnitMemory,
    prefetch_points,
    stage_order,
    unit_memory,
)
from pipeswap.swap.swap_config import DEFAULT_BUCKET_BYTES

__all__ = ["layout_graph"]


def layout_graph(
    schedule: Schedule,
    stages: Sequence[StageCosts],
    placement: Sequence[Sequence[str]],
    plans: Sequence[StagePlan] | None = None,
    *,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
) -> TaskGraph:
    """The graph of ``schedule`` on every replica of ``placement`` (one row of GPUs per
    replica, one GPU per stage), with each stage's swap ``plans`` (none by default).

    Task ids are those of ``pipeline_task_graph`` (``s1:F3``, ``s0:SEND_F2``,
    ``s2:UPDATE0``, ``s0:init``), with ``s{k}:out{u}``, ``s{k}:in{u}`` and ``s{k}:r{u}``
    for a unit's d2h, h2d and recompute, and ``s{k}:allreduce{step}``; with several
    replicas, a replica's tasks start with ``r{r}/``.
    """
    n = schedule.num_stages
    plans = list(plans) if plans is not None else [NO_PLAN] * n
    if len(stages) != n or len(plans) != n or any(len(row) != n for row in placement):
        raise PipeswapError(
            f"a {n}-stage schedule needs {n} stage costs, {n} plans and {n} GPUs per replica "
            f"(got {len(stages)}, {len(plans)} and {[len(row) for row in placement]})"
        )
    used = [gpu for row in placement for gpu in row]
    if len(set(used)) != len(used):
        raise PipeswapError(f"placement {[list(r) for r in placement]} puts two stages on one GPU")
    units = [unit_memory(c, p) for c, p in zip(stages, plans)]
    buckets = [
        buckets_of(c.layer_param_bytes, bucket_bytes) if len(placement) > 1 else [] for c in stages
    ]
    issue_after = [prefetch_points(stage_order(schedule, k), plans[k].lead) for k in range(n)]
    replicas = len(placement)
    closing = _closing_units(schedule)
    prefix = [f"r{r}/" if replicas > 1 else "" for r in range(replicas)]
    builder = GraphBuilder()
    previous: dict[tuple[int, int], str] = {}
    # Per replica and stage, the task of each F/B/UPDATE in the stage's order (recomputes
    # aside): a prefetch depends on one of them.
    computes: dict[tuple[int, int], list[str]] = {}
    for r, row in enumerate(placement):
        for k, gpu in enumerate(row):
            task = builder.compute(
                gpu, 0.0, alloc_bytes=stages[k].resident_bytes, id=f"{prefix[r]}s{k}:init"
            )
            previous[(r, k)] = task
            computes[(r, k)] = []
    timeline = unit_time_order(
        schedule,
        forward_cost=max(sum(c.forward_s for c in stages) / n, 1e-9),
        backward_cost=max(sum(c.backward_s for c in stages) / n, 1e-9),
    )
    ordered = sorted(range(len(timeline)), key=lambda i: (timeline[i].start, i))
    for i in ordered:
        k, action = timeline[i].stage, timeline[i].action
        kind, u = action.kind, action.unit
        c, unit = stages[k], units[k]
        closes = replicas > 1 and kind is ActionKind.B and closing[(k, schedule.step_of(u))] == u
        for r, row in enumerate(placement):
            p, gpu = prefix[r], row[k]
            name = f"{p}s{k}:{kind}{u}"
            if kind is ActionKind.F:
                deps = [previous[(r, k)]] + ([f"{p}s{k - 1}:SEND_F{u}"] if k > 0 else [])
                task = builder.compute(
                    gpu,
                    c.forward_s,
                    deps=deps,
                    alloc_bytes=unit.full + c.transient_bytes,
                    free_bytes=c.transient_bytes,
                    id=name,
                )
                if unit.swap:
                    out = f"{p}s{k}:out{u}"
                    builder.d2h(gpu, unit.swap, deps=[task], free_bytes=unit.swap, id=out)
            elif kind is ActionKind.B:
                deps = [previous[(r, k)]] + ([f"{p}s{k + 1}:SEND_B{u}"] if k < n - 1 else [])
                point = issue_after[k].get(u)
                after = None if point is None else computes[(r, k)][point]
                chunks = _chunks(c, buckets[k]) if closes and buckets[k] else [(0, c.backward_s)]
                task = _backward(builder, gpu, c, unit, deps, after, p, k, u, chunks)
            elif kind is ActionKind.UPDATE:
                deps = [previous[(r, k)]] + [
                    _reduce_id(k, u, b, buckets[k]) for b in range(len(buckets[k]))
                ]
                task = builder.compute(gpu, c.update_s, deps=deps, id=name)
            elif kind is ActionKind.SEND_F:
                builder.p2p(gpu, row[k + 1], c.out_bytes, deps=[f"{p}s{k}:F{u}"], id=name)
                continue
            elif kind is ActionKind.SEND_B:
                out_bytes = stages[k - 1].out_bytes
                builder.p2p(gpu, row[k - 1], out_bytes, deps=[f"{p}s{k}:B{u}"], id=name)
                continue
            else:
                continue  # a RECV is the dependency of the pass that needs it
            previous[(r, k)] = task
            computes[(r, k)].append(task)
        if closes:
            # Every bucket but the last starts as its part of the backward ends on every
            # replica, ahead of the SEND_B on the comm streams; the last one after it (stage
            # 0 sends nothing), so the previous stage never waits for more than the buckets
            # still running when the backward ends.
            for b in range(len(buckets[k]) - (1 if k > 0 else 0)):
                _reduce(builder, placement, prefix, k, u, b, buckets[k], schedule.step_of(u))
        sent = kind is ActionKind.SEND_B and buckets[k]
        if sent and closing[(k, schedule.step_of(u))] == u:
            last = len(buckets[k]) - 1
            _reduce(builder, placement, prefix, k, u, last, buckets[k], schedule.step_of(u))
    return builder.build()


def _reduce_id(k: int, step: int, b: int, buckets: Sequence[Bucket]) -> str:
    """``s{k}:allreduce{step}`` for the last bucket, ``...{step}.{b}`` for the others."""
    return f"s{k}:allreduce{step}" + ("" if b == len(buckets) - 1 else f".{b}")


def _reduce(
    builder: GraphBuilder,
    placement: Sequence[Sequence[str]],
    prefix: Sequence[str],
    k: int,
    u: int,
    b: int,
    buckets: Sequence[Bucket],
    step: int,
) -> None:
    chunk = "" if b == len(buckets) - 1 else f".{b}"
    builder.allreduce(
        [row[k] for row in placement],
        buckets[b].bytes,
        deps=[f"{prefix[r]}s{k}:B{u}{chunk}" for r in range(len(placement))],
        id=_reduce_id(k, step, b, buckets),
    )


def _chunks(c: StageCosts, buckets: Sequence[Bucket]) -> list[tuple[int, float]]:
    """The backward of a stage cut where each bucket but the last is complete:
    (bucket, seconds) in the order they run; the last chunk takes the remaining layers."""
    chunks: list[tuple[int, float]] = []
    top = len(c.layers)
    for b, bucket in enumerate(buckets[:-1]):
        chunks.append((b, sum(c.layer_backward_s[bucket.layer : top])))
        top = bucket.layer
    chunks.append((len(buckets) - 1, sum(c.layer_backward_s[:top])))
    return chunks


def _backward(
    builder: GraphBuilder,
    gpu: str,
    c: StageCosts,
    unit: UnitMemory,
    deps: list[str],
    after: str | None,
    prefix: str,
    k: int,
    u: int,
    chunks: Sequence[tuple[int, float]],
) -> str:
    """A unit's backward: its prefetch (issued after the task ``after``) and its recompute
    first when the plan has them; in ``chunks`` (one per gradient bucket, the last named
    ``B{u}``, the others ``B{u}.{bucket}``) when it closes a data-parallel step."""
    if unit.swap:
        assert after is not None, "a swapped unit has a prefetch point"
        deps.append(
            builder.h2d(
                gpu,
                unit.swap,
                deps=[after, f"{prefix}s{k}:out{u}"],
                alloc_bytes=unit.swap,
                id=f"{prefix}s{k}:in{u}",
            )
        )
    if unit.recomputes:
        deps[0] = builder.compute(
            gpu,
            unit.recompute_s,
            deps=[deps[0]],
            alloc_bytes=unit.rerun + c.transient_bytes,
            free_bytes=c.transient_bytes,
            id=f"{prefix}s{k}:r{u}",
        )
    task = ""
    for i, (b, seconds) in enumerate(chunks):
        first, last = i == 0, i == len(chunks) - 1
        task = builder.compute(
            gpu,
            c.backward_s if len(chunks) == 1 else seconds,
            deps=deps if first else [task],
            alloc_bytes=c.transient_bytes if first else 0,
            free_bytes=unit.full + unit.rerun + c.transient_bytes if last else 0,
            id=f"{prefix}s{k}:B{u}" + ("" if last else f".{b}"),
        )
    return task


def _closing_units(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Per (stage, step): the unit whose backward is the stage's last of that mini-batch."""
    last: dict[tuple[int, int], int] = {}
    for k in range(schedule.num_stages):
        for a in schedule.compute_actions(k):
            if a.kind is ActionKind.B:
                last[(k, schedule.step_of(a.unit))] = a.unit
    return last
