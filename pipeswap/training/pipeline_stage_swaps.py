"""Stages that swap: each stage's plan from the run's swap settings, and the swapper that runs it.

A pipeline run with swap settings (``--pipeline K --swap-policy P --gpu-memory SIZE``)
plans every stage from its own timeline (pipeswap.swap.plan.stage_swap: which layers'
saved tensors go to host memory, which recompute, how early each unit comes back) within
the budget per GPU, the stages that share a PCIe switch coordinated as data-parallel GPUs
are (pipeswap.swap.plan.stage_plans), and runs each plan with a
:class:`~pipeswap.swap.runtime.unit_swapper.UnitSwapper` in the stage's executor.

What a policy lets a stage do is its entry's StageMoves (pipeswap.swap.swap_config.POLICY_KINDS):
``auto`` and ``hybrid`` swap or recompute, coordinated;
``disjoint`` and ``bidirectional`` only swap, coordinated (each stage swaps within its
share of its switch); ``oblivious`` only swaps, each stage as if its link were its own
(Mobius-like); ``recompute`` and ``finer`` only recompute (whole blocks);
``save-on-cpu`` swaps every layer; ``none`` keeps everything; ``mip`` is refused.
A stage recomputes only where its backward sees the weights
its forward saw (synchronous schedules, or weights that stash): elsewhere a re-run would
compute other activations, so those stages only swap.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import ConfigError, require
from pipeswap.dist.group import single_threaded
from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import gpu_spec
from pipeswap.pipeline.emulator import pipeline_schedule
from pipeswap.pipeline.job import build_full_model, build_meta_model
from pipeswap.pipeline.predict import version_distances
from pipeswap.pipeline.stage_memory import MemoryFactory
from pipeswap.pipeline.stage_rehearsal import StageReading, rehearse_stages
from pipeswap.precision import autocast
from pipeswap.profiling.estimate import estimate
from pipeswap.profiling.measure import measure
from pipeswap.profiling.meta_attention import meta_attention_like_cpu
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.orders import peak_in_flight
from pipeswap.schedule.partition import stage_bounds
from pipeswap.schedule.timetable import Schedule
from pipeswap.swap.plan.stage_costs import StageCosts, stage_costs
from pipeswap.swap.plan.stage_mapping import Placement, replica_major
from pipeswap.swap.plan.stage_plans import plan_stages
from pipeswap.swap.plan.stage_swap import (
    LEADS,
    StagePlan,
    floor_bytes,
    peak_bytes,
    prefetch_points,
    stage_order,
)
from pipeswap.swap.runtime.capture import resolve_layers
from pipeswap.swap.runtime.learning import learnt_by
from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.transfer import DeviceLedger
from pipeswap.swap.runtime.unit_swapper import UnitSwapper
from pipeswap.swap.swap_config import POLICY_KINDS, policy_kind
from pipeswap.train_config import TrainConfig
from pipeswap.training.data_parallel import swap_topology
from pipeswap.units import format_bytes, format_ratio_at_most

__all__ = [
    "DEFAULT_GPU",
    "StageSwapPlans",
    "measured_stage_costs",
    "micro_profile",
    "micro_stage_costs",
    "placed_gpu",
    "plan_profile",
    "plan_stage_swaps",
    "recompute_allowed",
    "recompute_bytes",
    "stage_swappers",
]

# The spec plans on CUDA are estimated at when the topology names none (pipeswap.hardware.gpus).
DEFAULT_GPU = "v100-32gb"


@dataclass(frozen=True)
class StageSwapPlans:
    """Every stage's plan (``plans``, by model layer index), the costs it was made from,
    the budget per GPU, and per stage the planned peak and what the budget leaves for
    saved tensors (the budget less the stage's resident bytes and largest working set)."""

    policy: str
    budget_bytes: int
    plans: tuple[StagePlan, ...]
    costs: tuple[StageCosts, ...]
    recompute_allowed: tuple[bool, ...]
    # The GPU (of the topology's, named) of each stage of each replica, and the topology's
    # GPUs in order: the coordinated policies' cross mapping, Mobius's for oblivious.
    placement: Placement = ()
    gpus: tuple[str, ...] = ()

    def gpu_index(self, rank: int) -> int:
        """Where rank ``rank`` (stage k of replica d: d x K + k) sits among the GPUs."""
        replica, stage = divmod(rank, len(self.plans))
        return self.gpus.index(self.placement[replica][stage])

    def planned_peak_bytes(self, schedule: Schedule) -> list[int]:
        return [
            peak_bytes(stage_order(schedule, k), c, p)
            for k, (c, p) in enumerate(zip(self.costs, self.plans))
        ]

    def saved_budget_bytes(self) -> list[int]:
        return [self.budget_bytes - c.resident_bytes - c.transient_bytes for c in self.costs]

    def to_json(self, schedule: Schedule) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "budget_bytes": self.budget_bytes,
            "placement": [list(row) for row in self.placement],
            "stages": [
                {
                    "stage": k,
                    "swapped_layers": sorted(p.swapped),
                    "recomputed_layers": sorted(p.recomputed),
                    "prefetch_lead": p.lead,
                    "may_recompute": may,
                    "planned_peak_bytes": peak,
                    "saved_budget_bytes": saved,
                }
                for k, (p, may, peak, saved) in enumerate(
                    zip(
                        self.plans,
                        self.recompute_allowed,
                        self.planned_peak_bytes(schedule),
                        self.saved_budget_bytes(),
                    )
                )
            ],
        }


def micro_profile(config: TrainConfig) -> Profile:
    """The model measured at one micro-batch, alone, on the run's device and precision
    (with every saved tensor on the host where the stages swap: within a plan's memory)."""
    assert config.device is not None
    threads = single_threaded() if config.device == "cpu" else nullcontext()
    swapping = config.swap is not None and learnt_by(config.swap.policy) == "on-host"
    with threads, autocast(config.precision, torch.device(config.device)):
        return measure(
            build_full_model(config, config.device),
            config.micro_batch_size,
            seq_len=config.seq_len,
            image_size=config.image_size,
            device=config.device,
            optimizer=config.optim.name,
            saved_on_host=swapping,
        )


def plan_profile(config: TrainConfig, gpu: str | None) -> Profile:
    """What stage plans are made from: on the CPU the model measured at one micro-batch
    (:func:`micro_profile`); on CUDA an estimate on the meta device at ``gpu``'s spec, so
    the launching process never touches a GPU and a model no one GPU holds still plans
    (its sizes in float32: under bf16-mixed a conservative count)."""
    if config.device != "cuda":
        return micro_profile(config)
    try:
        spec = gpu_spec(gpu or DEFAULT_GPU)
    except PipeswapError:  # a topology of GPUs without a known spec: times matter less here
        spec = gpu_spec(DEFAULT_GPU)
    return estimate(
        build_meta_model(config),
        config.micro_batch_size,
        seq_len=config.seq_len,
        image_size=config.image_size,
        gpu=spec,
        optimizer=config.optim.name,
    )


def recompute_bytes(config: TrainConfig) -> tuple[list[int], list[int]]:
    """Per layer, what recomputing it holds from forward to backward and what its re-run
    saves, as the runtime recomputes (a forward with every layer wrapped, at one
    micro-batch). A profile cannot tell: the loss after the last layer keeps what it saves
    (the log-probabilities) however that layer is recomputed. On the CPU it runs there;
    elsewhere on the meta device (as :func:`plan_profile`, in float32)."""
    assert config.device is not None
    device = torch.device("cpu" if config.device == "cpu" else "meta")
    model = build_full_model(config, device) if device.type == "cpu" else build_meta_model(config)
    x, y = model.example_batch(
        config.micro_batch_size,
        seq_len=config.seq_len,
        image_size=config.image_size,
        device=device,
    )
    names = list(model.layer_names)
    layers = resolve_layers(model, names)
    recomputation = Recomputation(layers, names, DeviceLedger(), account=True)
    recomputation.install()
    # The meta device does not autocast: there the sizes stay float32, a conservative count.
    cast = autocast(config.precision, device) if device.type == "cpu" else nullcontext()
    try:
        with cast, meta_attention_like_cpu():
            recomputation.capture(model, lambda: model.loss(model(x), y), names)
    finally:
        recomputation.remove()
    kept, rerun = recomputation.kept_bytes, recomputation.rerun_bytes
    return [kept[n] for n in names], [rerun[n] for n in names]


def micro_stage_costs(config: TrainConfig, profile: Profile) -> tuple[StageCosts, ...]:
    """Every stage's costs per unit, from a profile of one micro-batch (:func:`micro_profile`)."""
    pipeline = config.require_pipeline()
    return stage_costs(
        profile,
        pipeline.stage_balance,
        schedule=pipeline.schedule,
        micro_batches=1,  # the profile is one micro-batch already
        weights=pipeline.weights,
    )


def recompute_allowed(config: TrainConfig, schedule: Schedule) -> list[bool]:
    """Per stage: whether every unit's backward runs on the weights its forward used."""
    pipeline = config.require_pipeline()
    if weight_mode(pipeline.weights).stashes:
        return [True] * pipeline.num_stages
    allowed = []
    for k in range(pipeline.num_stages):
        d = version_distances(schedule, k, pipeline.distances)
        forward = {u: s for (kind, u), s in d.items() if kind is ActionKind.F}
        allowed.append(all(d.get((ActionKind.B, u), s) == s for u, s in forward.items()))
    return allowed


def plan_stage_swaps(config: TrainConfig, profile: Profile | None = None) -> StageSwapPlans | None:
    """The stage plans of a resolved pipeline run with swap settings (None: it keeps
    everything). Raises ConfigError for a budget no plan fits, naming the smallest."""
    swap, pipeline = config.swap, config.require_pipeline()
    if swap is None:
        return None
    stages = policy_kind(swap.policy).stages
    if stages is None:
        planned = [k.name for k in POLICY_KINDS.values() if k.stages and k.stages.moves_anything]
        raise ConfigError(
            f"{{policy}} {swap.policy} plans data-parallel swaps; a pipeline's stages plan "
            f"with {', '.join(planned[:-1])} or {planned[-1]}"
        )
    if not stages.moves_anything:
        return None
    assert config.device is not None
    schedule = pipeline_schedule(config)
    topology = swap_topology(config.topology, config.device, pipeline.num_ranks)
    gpus = topology.require_gpus(config.topology)[: pipeline.num_ranks]
    profile = profile or plan_profile(config, topology.node(gpus[0]).spec)
    # What each stage's device holds, as its meter reads a rehearsal of the stage.
    readings = rehearse_stages(config)
    costs = tuple(
        measured_stage_costs(c, r) for c, r in zip(micro_stage_costs(config, profile), readings)
    )
    allowed = recompute_allowed(config, schedule)
    if stages.recompute and any(allowed):
        kept, rerun = recompute_bytes(config)
        costs = tuple(
            replace(
                c,
                kept=tuple(kept[i] for i in c.layers),
                rerun=tuple(rerun[i] for i in c.layers),
            )
            for c in costs
        )
    orders = [stage_order(schedule, k) for k in range(pipeline.num_stages)]
    alone = [peak_bytes(order, c, StagePlan()) for order, c in zip(orders, costs)]
    if swap.footprint_ratio is not None:
        budget = int(max(alone) / swap.footprint_ratio)
    elif swap.gpu_memory_bytes is not None:
        budget = swap.gpu_memory_bytes
    else:
        budget = min(topology.node(g).memory_bytes for g in gpus)
    if stages.every_layer:
        plans = [StagePlan(frozenset(c.layers), frozenset(), LEADS[0]) for c in costs]
        placement = replica_major(gpus, pipeline.num_stages, pipeline.replicas)
    else:
        moves, may, coordinated = stages.swap, stages.recompute, stages.coordinated
        found = plan_stages(
            topology,
            gpus,
            schedule,
            costs,
            orders,
            budget,
            replicas=pipeline.replicas,
            coordinated=coordinated,
            swap=moves,
            recompute=[may and a for a in allowed],
        )
        if found is None:
            smallest = max(
                floor_bytes(order, c, swap=moves, recompute=may and a)
                for order, c, a in zip(orders, costs, allowed)
            )
            require(
                False,
                f"no {swap.policy} plan keeps every stage within {format_bytes(budget)} per "
                f"GPU: the smallest budget that works is {smallest} bytes "
                f"({format_bytes(smallest)}), a footprint ratio of at most "
                f"{format_ratio_at_most(max(alone), smallest)}: pass {{gpu_memory_bytes}} {smallest} or more"
                + ("" if all(allowed) or not may else _NO_RECOMPUTE)
                + (_SWAPS_FREE_NOTHING if smallest >= max(alone) else ""),
            )
        assert found is not None
        plans, placement = found
    return StageSwapPlans(
        swap.policy,
        budget,
        tuple(plans),
        tuple(costs),
        tuple(allowed),
        placement,
        tuple(topology.gpus),
    )


_SWAPS_FREE_NOTHING = (
    "; no plan lowers the peak here: at its peak every unit the stage holds is computing or "
    "still copying (a copy holds its bytes through the next action); more stages or "
    "micro-batches keep units in flight longer, and recomputing frees memory at once"
)
_NO_RECOMPUTE = (
    " (stages whose backward runs on newer weights than their forward only swap: "
    "weights that stash, or a synchronous schedule, let them recompute)"
)


def measured_stage_costs(costs: StageCosts, reading: StageReading) -> StageCosts:
    """``costs`` with what the stage's device held as it rehearsed (``reading``): its
    resident bytes (tied copies, gradients, optimizer state, messages posted ahead, and
    the weight mode's copies), a unit's bytes beyond its saved tensors, and the working
    sets of a forward, a backward and an update. Never less than the profile's counts."""
    return replace(
        costs,
        resident_bytes=max(costs.resident_bytes, reading.resident_bytes + costs.weight_copy_bytes),
        transient_bytes=max(costs.transient_bytes, reading.forward_bytes),
        backward_transient_bytes=max(costs.transient_bytes, reading.backward_bytes),
        update_transient_bytes=reading.update_bytes,
        unit_extra_bytes=max(0, reading.unit_bytes - costs.saved_bytes),
    )


def placed_gpu(plans: StageSwapPlans, rank: int, ranks: int, gpu_count: int) -> int | None:
    """The local GPU of ``rank`` by the plans' placement (stages that copy at the same time
    under different switches), when every one of the ``ranks`` has a GPU of its own on a
    machine whose ``gpu_count`` GPUs the topology lists in order; None otherwise."""
    if ranks > gpu_count or len(plans.gpus) != gpu_count or not plans.placement:
        return None
    return plans.gpu_index(rank)


def stage_swappers(config: TrainConfig, plans: StageSwapPlans, schedule: Schedule) -> MemoryFactory:
    """What builds each stage's :class:`UnitSwapper` in its executor."""
    balance = config.require_pipeline().stage_balance

    def build(stage: int, module: nn.Module) -> UnitSwapper:
        first, _ = stage_bounds(balance)[stage]
        names = [name for name, _ in module.named_children()]
        plan = plans.plans[stage]
        actions = schedule.actions[stage]
        compute = [i for i, a in enumerate(actions) if a.is_compute]
        prefetch_at: dict[int, list[int]] = {}
        for unit, position in prefetch_points(stage_order(schedule, stage), plan.lead).items():
            prefetch_at.setdefault(compute[position], []).append(unit)
        device = next(module.parameters()).device
        return UnitSwapper(
            module,
            names,
            swapped=_names(names, plan.swapped, first),
            recomputed=_names(names, plan.recomputed, first),
            capacity=max(1, peak_in_flight(list(actions))),
            prefetch_at=prefetch_at,
            device=device,
        )

    return build


def _names(names: Sequence[str], layers: frozenset[int], first: int) -> list[str]:
    return [names[i - first] for i in sorted(layers)]
