"""Pipelined training: the stage balance, then one process per stage or the one-process emulator."""

from __future__ import annotations

from dataclasses import replace

import torch

from pipeswap.checkpoint import CheckpointPlan
from pipeswap.config_fields import require
from pipeswap.dist.env import local_rank_of, torchrun_env
from pipeswap.dist.group import rank_device
from pipeswap.dist.launch import run_ranks
from pipeswap.dist.replica_groups import BUCKET_BYTES
from pipeswap.layouts.graphs import layout_graph
from pipeswap.pipeline.emulator import Emulator, pipeline_schedule
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.pipeline.result import PipelineResult
from pipeswap.pipeline.runtime import run_stage_rank
from pipeswap.schedule.taskgraph import pipeline_graph
from pipeswap.sim.engine import simulate
from pipeswap.swap.plan.stage_mapping import replica_major
from pipeswap.train_config import TrainConfig
from pipeswap.training.data_parallel import swap_topology
from pipeswap.training.pipeline_stage_swaps import (
    StageSwapPlans,
    micro_profile,
    micro_stage_costs,
    placed_gpu,
    plan_stage_swaps,
    stage_swappers,
)
from pipeswap.training.report import PipelineDetails, TrainReport, details_from_json
from pipeswap.training.resume import agree_on_run, checkpointing

__all__ = ["predicted_step_s", "report", "run_pipeline", "with_plans"]


def run_pipeline(config: TrainConfig) -> PipelineResult | None:
    """Run a pipeline config: emulated here, or one rank per stage.

    Returns the combined result on rank 0 (and in the emulator), None on other ranks.
    """
    env = torchrun_env()
    given = config.require_pipeline()
    if env is not None and config.nproc is None and given.replicas == 1 and not given.emulate:
        # Under torchrun, K stages on N ranks: N / K replicas (as --nproc N says).
        stages = given.num_stages
        if env.world_size > stages and env.world_size % stages == 0:
            config = replace(config, pipeline=replace(given, replicas=env.world_size // stages))
    config = resolve_pipeline(config)
    pipeline = config.require_pipeline()
    assert config.device is not None
    # The emulator and the runtime read each other's checkpoints: one identity for both.
    checkpoint, resume = checkpointing(
        config,
        pipeline.num_ranks,
        balance=list(pipeline.stage_balance),
        schedule=pipeline.schedule,
        weights=pipeline.weights,
        distances=pipeline.distances,
        micro_batches=pipeline.micro_batch_count,
        replicas=pipeline.replicas,
    )
    plans = plan_stage_swaps(config)
    if pipeline.emulate:
        memory = stage_swappers(config, plans, pipeline_schedule(config)) if plans else None
        emulator = Emulator(
            config, record=True, checkpoint=checkpoint, resume=resume, memory=memory
        )
        return with_plans(emulator.run(progress=config.progress), plans)
    require(
        env is None or config.nproc is not None or env.world_size == pipeline.num_ranks,
        f"torchrun started {env.world_size if env else 0} ranks for {{stages}} "
        f"{pipeline.num_stages} x {{replicas}} {pipeline.replicas}: use torchrun's "
        f"--nproc-per-node {pipeline.num_ranks} (a multiple of the stages)",
    )
    nproc = None if env is not None and config.nproc is None else pipeline.num_ranks
    result: PipelineResult | None = run_ranks(
        _stage_rank,
        nproc,
        config,
        checkpoint,
        resume,
        plans,
        device=config.device,
        timeout_s=config.timeout_s,
        stop_grace_s=5.0 if checkpoint is None else config.timeout_s + 30.0,
    )
    if result is None:
        return None
    return with_plans(replace(result, predicted_step_s=predicted_step_s(config, plans)), plans)


def with_plans(result: PipelineResult, plans: StageSwapPlans | None) -> PipelineResult:
    """``result`` with the stage swap plans it ran (None: its stages kept everything)."""
    if plans is None:
        return result
    return replace(result, stage_swap=plans.to_json(pipeline_schedule(result.config)))


def predicted_step_s(config: TrainConfig, plans: StageSwapPlans | None = None) -> float:
    """The simulator's step time of a resolved pipeline run: its schedule as a task graph
    (pipeswap.schedule.taskgraph) over a profile of the model measured here, alone, on
    the run's device, simulated on its ``topology`` or the device's default (the run's whole
    makespan over its steps: fill and drain included, as a measured run's wall time).

    The profile is measured at the micro-batch's size, as each action computes (a small
    batch costs more than its share of a large one), and times the optimizer step that
    each stage's UPDATE takes its parameters' share of. A calibrated machine slows it by
    the measured ``stage_slowdown`` (every rank computes at once) and ``transfer_slowdown``
    (a stage computes while its transfers go on). Stages that swap (``plans``) copy and
    recompute in the graph as their plans say.
    """
    pipeline = config.require_pipeline()
    assert config.device is not None
    profile = micro_profile(config)
    topology = swap_topology(config.topology, config.device, pipeline.num_ranks)
    calibration = topology.calibration or {}
    slowdown = float(calibration.get("stage_slowdown") or 1.0) * float(
        calibration.get("transfer_slowdown") or 1.0
    )
    if slowdown > 1.0:
        # Measured alone; a stage computes beside the other ranks and its own transfers.
        profile = profile.slowed(slowdown, f"{slowdown:.2f}x: beside other ranks and transfers")
    schedule = pipeline_schedule(config)
    if pipeline.replicas > 1 or plans is not None:
        # Each stage averages its gradients over the replicas in DDP's buckets, each
        # gathering as soon as its last backward of the mini-batch has completed it.
        stages = micro_stage_costs(config, profile)
        placement = (
            plans.placement
            if plans is not None
            else replica_major(topology.gpus, pipeline.num_stages, pipeline.replicas)
        )
        graph = layout_graph(
            schedule,
            stages,
            placement,
            plans.plans if plans else None,
            bucket_bytes=BUCKET_BYTES,
        )
    else:
        graph = pipeline_graph(
            schedule,
            profile,
            topology,
            pipeline.stage_balance,
            unit_scale=1.0,
            weights=pipeline.weights,
        )
    return simulate(graph, topology, gpu_memory_bytes=0).makespan_s / config.steps


def _stage_rank(
    rank: int,
    world: int,
    config: TrainConfig,
    checkpoint: CheckpointPlan | None,
    resume: tuple[str, int] | None,
    plans: StageSwapPlans | None,
) -> PipelineResult | None:
    assert config.device is not None
    where = rank_device(config.device, local_rank_of(rank))
    if where.type == "cuda" and plans is not None and torchrun_env() is None:
        # Stages that swap sit where their plans were made for (the cross mapping); under
        # torchrun each rank keeps GPU LOCAL_RANK, as torchrun's users expect.
        placed = placed_gpu(plans, rank, world, torch.cuda.device_count())
        where = where if placed is None else torch.device("cuda", placed)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    return run_stage_rank(
        config,
        device=where,
        progress=config.progress,
        checkpoint=agree_on_run(checkpoint, world),
        resume=resume,
        memory=stage_swappers(config, plans, pipeline_schedule(config)) if plans else None,
    )


def report(result: PipelineResult) -> TrainReport:
    """The ``pipeswap.train/2`` report of a pipeline run (runtime or emulator)."""
    config = result.config
    calibrated = None
    if result.predicted_step_s is not None:
        assert config.device is not None
        ranks = config.require_pipeline().num_ranks
        calibrated = swap_topology(config.topology, config.device, ranks).calibration is not None
    return TrainReport.of(
        config,
        losses=result.losses,
        params_sha256=result.params_sha256,
        nproc=1 if result.mode == "emulate" else config.require_pipeline().num_ranks,
        evals=result.evals,
        pipeline=details_from_json(PipelineDetails, result.to_report()),
        calibrated=calibrated,
    )
