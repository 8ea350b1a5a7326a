"""Simulate one layout's task graph and read its steady-state rate, peak memory and makespan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeswap.config_fields import ConfigError
from pipeswap.hardware.topology import Topology
from pipeswap.layouts.graphs import layout_graph
from pipeswap.layouts.layout import (
    DATA_PARALLEL,
    PIPELINE,
    PIPELINE_DP,
    PIPELINE_SWAP,
    Layout,
    StageLayout,
)
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.timetable import Schedule
from pipeswap.sim.engine import DeadlockError, simulate
from pipeswap.sim.graph import TaskGraph
from pipeswap.sim.result import SimResult
from pipeswap.swap.plan.planner import PlanResult
from pipeswap.swap.plan.stage_costs import StageCosts
from pipeswap.swap.plan.stage_swap import StagePlan

__all__ = ["Scored", "score_data_parallel", "score_pipeline", "steady_rate_s"]


@dataclass(frozen=True)
class Scored:
    """A layout with the exact graph that was simulated, on the topology whose GPUs have
    the budget as memory (so ``simulate(graph, topology)`` gives ``result`` again)."""

    layout: Layout
    graph: TaskGraph
    result: SimResult
    topology: Topology


def steady_rate_s(result: SimResult, schedule: Schedule, replicas: int) -> float:
    """Seconds per step in the steady state: between the ends of UPDATE ``S/4`` and
    UPDATE ``3S/4`` (the last of any stage, any replica) of ``S`` steps, so neither the
    pipeline's fill nor its drain counts (a schedule without flush updates a mini-batch
    only after forwards of the next have run)."""
    prefixes = [f"r{r}/" for r in range(replicas)] if replicas > 1 else [""]

    def done(step: int) -> float:
        return max(
            result.tasks[f"{p}s{k}:UPDATE{step}"].end_s
            for p in prefixes
            for k in range(schedule.num_stages)
        )

    first, last = schedule.num_steps // 4, 3 * schedule.num_steps // 4
    return (done(last) - done(first)) / (last - first)


def score_pipeline(
    profile: Profile,
    topology: Topology,
    budget_bytes: int,
    schedule: Schedule,
    weights: str,
    stages: Sequence[StageCosts],
    balance: Sequence[int],
    placement: Sequence[Sequence[str]],
    plans: Sequence[StagePlan],
    *,
    mapping: str,
    coordinated: bool,
    batch: int,
    notes: Sequence[str] = (),
) -> Scored | None:
    """Simulate the layout within the budget; None when it runs out of memory.

    ``profile`` is one replica's mini-batch; ``batch`` the per-GPU batch of the search.
    """
    limited = topology.with_gpu_memory(budget_bytes)
    graph = layout_graph(schedule, stages, placement, plans)
    try:
        result = simulate(graph, limited)
    except (ConfigError, DeadlockError):  # OutOfMemoryError is a ConfigError
        return None
    replicas = len(placement)
    swaps = any(not p.empty for p in plans)
    family = PIPELINE_DP if replicas > 1 else PIPELINE_SWAP if swaps else PIPELINE
    unit_samples = profile.batch // schedule.micro_batches
    per_step = replicas * profile.batch
    names = profile.layer_names
    stage_layouts = []
    for k, (c, plan) in enumerate(zip(stages, plans)):
        peak = max(result.gpus[row[k]].peak_bytes for row in placement)
        stage_layouts.append(
            StageLayout(
                stage=k,
                layers=tuple(names[i] for i in c.layers),
                swapped=tuple(names[i] for i in sorted(plan.swapped)),
                recomputed=tuple(names[i] for i in sorted(plan.recomputed)),
                prefetch_lead=plan.lead if plan.swapped else 0,
                peak_bytes=peak,
            )
        )
    layout = Layout(
        family=family,
        model=profile.model,
        topology=topology.name,
        budget_bytes=budget_bytes,
        batch=batch,
        stages=schedule.num_stages,
        replicas=replicas,
        samples_per_step=per_step,
        samples_per_update=replicas * unit_samples * schedule.micro_batches,
        samples_per_s=per_step / steady_rate_s(result, schedule, replicas),
        peak_bytes=max(g.peak_bytes for g in result.gpus.values()),
        graph_s=result.makespan_s,
        steps=schedule.num_steps,
        schedule=schedule.name,
        weights=weights,
        micro_batches=schedule.micro_batches,
        balance=tuple(balance),
        placement=tuple(tuple(row) for row in placement),
        mapping=mapping,
        coordinated=coordinated,
        stage_plans=tuple(stage_layouts),
        notes=tuple(notes),
    )
    return Scored(layout, graph, result, limited)


def score_data_parallel(plan: PlanResult, profile: Profile, topology: Topology) -> Scored:
    """A data-parallel plan (pipeswap.swap.plan.planner) as a layout: one iteration is one
    step, and every iteration is the same, so its time is the steady state."""
    gpus = len(plan.gpus)
    per_step = gpus * profile.batch * plan.plan.sync_every
    layout = Layout(
        family=DATA_PARALLEL,
        model=profile.model,
        topology=topology.name,
        budget_bytes=plan.budget_bytes,
        batch=profile.batch,
        stages=1,
        replicas=gpus,
        samples_per_step=per_step,
        samples_per_update=per_step,
        samples_per_s=per_step / plan.iteration_s,
        peak_bytes=max(g.peak_bytes for g in plan.gpus),
        graph_s=plan.iteration_s,
        steps=1,
        placement=tuple((g.gpu,) for g in plan.gpus),
        mapping="data-parallel",
        swap_policy=plan.policy,
    )
    return Scored(layout, plan.graph, plan.result, plan.topology)
