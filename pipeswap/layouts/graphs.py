"""The task graph of D replicas of a K-stage pipeline whose stages may swap (pipeswap.graph/1).

Stage k of replica r runs on ``placement[r][k]``. Every F/B/UPDATE is a compute task
after the previous one of its GPU, every SEND a p2p, as
:func:`pipeswap.pipeline.taskgraph.pipeline_task_graph` builds them; on top of that:

- **stage swapping** (a :class:`StagePlan` per stage): after a unit's forward a d2h
  takes its swapped bytes to host (freeing them); an h2d brings them back (allocating
  them) once the plan's ``lead``-th compute action before the unit's backward has
  ended, and the backward waits for it; a recompute task (the recomputed layers'
  forward again, allocating what they save) runs right before the backward.
- **data parallelism** (D > 1): when a stage has run the last backward of a mini-batch
  on every replica, an all-reduce of its gradients over those replicas' GPUs starts on
  their comm streams, overlapping the other stages' backward passes (DDP overlaps
  buckets within one backward in the same way); the stage's UPDATE waits for it.

Memory: a ``init`` task holds each stage's resident bytes; a forward allocates the
unit's saved tensors and the stage's working set, the backward frees them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeswap.errors import PipeswapError
from pipeswap.layouts.stage_swap import (
    NO_PLAN,
    StagePlan,
    UnitMemory,
    prefetch_points,
    stage_order,
    unit_memory,
)
from pipeswap.layouts.stages import StageCosts
from pipeswap.pipeline.actions import ActionKind
from pipeswap.pipeline.schedule import Schedule, unit_time_order
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.graph import TaskGraph


def layout_graph(
    schedule: Schedule,
    stages: Sequence[StageCosts],
    placement: Sequence[Sequence[str]],
    plans: Sequence[StagePlan] | None = None,
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
    issue_after = [prefetch_points(stage_order(schedule, k), plans[k].lead) for k in range(n)]
    replicas = len(placement)
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
        k, action = timeline[i].rank, timeline[i].action
        kind, u = action.kind, action.unit
        c, unit = stages[k], units[k]
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
                task = _backward(builder, gpu, c, unit, deps, after, p, k, u)
            elif kind is ActionKind.UPDATE:
                deps = [previous[(r, k)]]
                if replicas > 1:
                    deps.append(f"s{k}:allreduce{u}")
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
        # The all-reduce goes after the backward's SEND_B on the comm streams (stage 0
        # sends nothing), so the previous stage's backward never waits for it.
        sent = kind is ActionKind.SEND_B or (kind is ActionKind.B and k == 0)
        if replicas > 1 and sent and _closes_step(schedule, k, u):
            builder.allreduce(
                [row[k] for row in placement],
                c.param_bytes,
                deps=[f"{prefix[r]}s{k}:B{u}" for r in range(replicas)],
                id=f"s{k}:allreduce{schedule.step_of(u)}",
            )
    return builder.build()


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
) -> str:
    """A unit's backward: its prefetch (issued after the task ``after``) and its recompute
    first when the plan has them."""
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
    return builder.compute(
        gpu,
        c.backward_s,
        deps=deps,
        alloc_bytes=c.transient_bytes,
        free_bytes=unit.full + unit.rerun + c.transient_bytes,
        id=f"{prefix}s{k}:B{u}",
    )


def _closes_step(schedule: Schedule, stage: int, unit: int) -> bool:
    """Whether ``unit``'s backward is the stage's last of its mini-batch."""
    step = schedule.step_of(unit)
    last = max(
        a.unit
        for a in schedule.compute_actions(stage)
        if a.kind is ActionKind.B and schedule.step_of(a.unit) == step
    )
    return unit == last
