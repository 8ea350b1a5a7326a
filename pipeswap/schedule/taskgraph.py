"""A schedule on real costs: stage compute and p2p transfers as a pipeswap.graph/1 task graph."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import Topology
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.partition import stage_bounds
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.schedule.timetable import Schedule, unit_time_order
from pipeswap.sim.graph import GRAPH_FORMAT, TaskGraph

__all__ = ["pipeline_graph", "pipeline_task_graph"]


def pipeline_task_graph(
    schedule: Schedule,
    profile: Profile,
    topology: Topology,
    balance: Sequence[int],
    *,
    gpus: Sequence[str] | None = None,
    unit_scale: float | None = None,
    update_s: float | None = None,
    weights: str = PipelineConfig.weights,
) -> dict[str, Any]:
    """The task graph of ``schedule`` with stage k on ``gpus[k]`` (default: topology order).

    Each F/B/UPDATE becomes a compute task that depends on the previous one of its stage
    (a GPU runs its actions in schedule order) and on the transfer it receives; each SEND
    becomes a p2p task of the activations (F) or input gradients (B) crossing the cut.
    The profile is per mini-batch, so a unit costs ``unit_scale`` of it (default
    1/micro_batches). Each stage's UPDATE takes ``update_s``, by default its parameters'
    share of the profile's timed optimizer step (0 when the profile has none). A forward
    allocates its stage's saved tensors, the backward frees
    them; a zero-time ``s{k}:init`` task holds weights, gradients, optimizer state and
    the weight mode's extra copies for the whole run.
    """
    n = schedule.num_stages
    if len(balance) != n or sum(balance) != len(profile.layers):
        raise PipeswapError(
            f"balance {list(balance)} must have {n} stages covering the profile's "
            f"{len(profile.layers)} layers"
        )
    placement = list(gpus) if gpus is not None else topology.gpus[:n]
    if len(placement) < n:
        raise PipeswapError(
            f"{topology.name} has {len(topology.gpus)} GPUs, too few for {n} stages"
        )
    scale = 1.0 / schedule.micro_batches if unit_scale is None else unit_scale
    stages = [profile.layers[a:b] for a, b in stage_bounds(balance)]
    forward = [sum(la.forward_s for la in s) * scale for s in stages]
    backward = [sum(la.backward_s for la in s) * scale for s in stages]
    saved = [int(sum(la.saved_bytes for la in s) * scale) for s in stages]
    out_bytes = [int(s[-1].output_bytes * scale) for s in stages]
    whole_update = profile.optimizer_step_s or 0.0
    updates = [
        whole_update * sum(la.param_bytes for la in s) / (profile.param_bytes or 1)
        if update_s is None
        else update_s
        for s in stages
    ]
    tasks: list[dict[str, Any]] = []
    mode, kind = weight_mode(weights), schedule.kind
    for k in range(n):
        params = sum(la.param_bytes for la in stages[k])
        share = profile.optimizer_state_bytes * params // (profile.param_bytes or 1)
        copies = mode.extra_weight_copies(kind.in_flight_units(n, k, schedule.micro_batches), kind)
        tasks.append(
            _task(
                f"s{k}:init", "compute", gpu=placement[k], alloc_bytes=(2 + copies) * params + share
            )
        )
    # Streams run their tasks in listing order, so list them in the order an idealized
    # run starts them (a topological order; ties keep the validator's order).
    timeline = unit_time_order(
        schedule,
        forward_cost=max(sum(forward) / n, 1e-9),
        backward_cost=max(sum(backward) / n, 1e-9),
    )
    ordered = sorted(range(len(timeline)), key=lambda i: (timeline[i].start, i))
    previous_of = {k: f"s{k}:init" for k in range(n)}
    for i in ordered:
        k, action = timeline[i].stage, timeline[i].action
        task = _action_task(
            k,
            action.kind,
            action.unit,
            previous_of[k],
            placement,
            n,
            forward,
            backward,
            saved,
            out_bytes,
            updates[k],
        )
        if task is not None:
            tasks.append(task)
            if task["kind"] == "compute":
                previous_of[k] = task["id"]
    return {"format": GRAPH_FORMAT, "tasks": tasks}


def _action_task(
    k: int,
    kind: ActionKind,
    unit: int,
    previous: str,
    placement: list[str],
    n: int,
    forward: list[float],
    backward: list[float],
    saved: list[int],
    out_bytes: list[int],
    update_s: float,
) -> dict[str, Any] | None:
    """The task of one action of stage k (None for a RECV: it is the dependency instead)."""
    name = f"s{k}:{kind}{unit}"
    gpu = placement[k]
    if kind is ActionKind.F:
        deps = [previous] + ([f"s{k - 1}:SEND_F{unit}"] if k > 0 else [])
        return _task(
            name, "compute", gpu=gpu, duration_s=forward[k], deps=deps, alloc_bytes=saved[k]
        )
    if kind is ActionKind.B:
        deps = [previous] + ([f"s{k + 1}:SEND_B{unit}"] if k < n - 1 else [])
        return _task(
            name, "compute", gpu=gpu, duration_s=backward[k], deps=deps, free_bytes=saved[k]
        )
    if kind is ActionKind.UPDATE:
        return _task(name, "compute", gpu=gpu, duration_s=update_s, deps=[previous])
    if kind is ActionKind.SEND_F:
        return _task(
            name, "p2p", src=gpu, dst=placement[k + 1], bytes=out_bytes[k], deps=[f"s{k}:F{unit}"]
        )
    if kind is ActionKind.SEND_B:
        return _task(
            name,
            "p2p",
            src=gpu,
            dst=placement[k - 1],
            bytes=out_bytes[k - 1],
            deps=[f"s{k}:B{unit}"],
        )
    return None


def pipeline_graph(*args: Any, **kwargs: Any) -> TaskGraph:
    """:func:`pipeline_task_graph` as a ``pipeswap.sim.graph.TaskGraph``."""
    return TaskGraph.from_json(pipeline_task_graph(*args, **kwargs))


def _task(task_id: str, kind: str, **fields: Any) -> dict[str, Any]:
    task: dict[str, Any] = {"id": task_id, "kind": kind}
    for key, value in fields.items():
        if value in (None, 0, 0.0, [], ()) and key not in ("duration_s",):
            continue
        task[key] = value
    if kind == "p2p":
        task.pop("duration_s", None)
    return task
