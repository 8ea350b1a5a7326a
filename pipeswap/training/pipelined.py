"""Pipelined training: the stage balance, then one process per stage or the one-process emulator."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipeswap.checkpoint import CheckpointPlan
from pipeswap.dist.env import local_rank_of, torchrun_env
from pipeswap.dist.group import rank_device
from pipeswap.dist.launch import run_ranks
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.config import PipelineConfig, build_meta_model
from pipeswap.pipeline.partition import check_balance, check_stage_count, partition
from pipeswap.pipeline.result import PipelineResult
from pipeswap.pipeline.stage import LayerInfo, flop_profile, inspect_layers
from pipeswap.profile import Profile
from pipeswap.training.config import PipelineOptions, TrainConfig
from pipeswap.training.data_parallel import check_profile_shape
from pipeswap.training.report import base_report
from pipeswap.training.resume import checkpointing


def pipeline_config(config: TrainConfig) -> PipelineConfig:
    """The PipelineConfig a resolved pipeline TrainConfig asks for, with its balance found."""
    options = config.pipeline
    assert options is not None and config.batch is not None and config.lr is not None
    draft = PipelineConfig(
        model=config.model,
        balance=(1,) * options.stages,
        schedule=options.schedule,
        weights=options.weights,
        optimizer=config.optimizer,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        batch=config.batch,
        micro_batches=options.micro_batch_count,
        steps=config.steps,
        seq_len=config.seq_len,
        image_size=config.image_size,
        seed=config.seed,
        data_seed=config.seed,
        eval_batches=options.eval_batches,
        timeout_s=config.timeout_s,
        distances=options.distances,
        lr_warmup=options.lr_warmup,
        error_feedback=options.error_feedback,
    )
    model = build_meta_model(draft)
    # Before the batch split: too many stages is the real problem when K also sets it.
    check_stage_count(len(model), options.stages, model.layer_names, config.model)
    if options.micro_batches is None and config.batch % draft.micro_batches:
        raise PipeswapError(
            f"--batch {config.batch} does not split into the {draft.micro_batches} "
            f"micro-batches {options.schedule} uses by default (one per stage): pass "
            f"--micro-batches M with M dividing {config.batch}, or a batch that is a multiple "
            f"of {draft.micro_batches}"
        )
    draft.check()
    infos = inspect_layers(draft)
    if options.balance is not None:
        balance = check_balance(options.balance, len(infos), options.stages)
    else:
        balance = _partition(config, options, draft, infos, model.name)
    return dataclasses.replace(draft, balance=balance)


def _partition(
    config: TrainConfig,
    options: PipelineOptions,
    draft: PipelineConfig,
    infos: list[LayerInfo],
    model_name: str,
) -> tuple[int, ...]:
    if config.profile_path is not None:
        profile = Profile.load(config.profile_path)
        _check_profile(config.profile_path, profile, draft, infos, model_name)
    else:
        if options.memory_cap_bytes is not None:
            raise PipeswapError("--memory-cap needs --profile (a measured or estimated profile)")
        profile = flop_profile(draft, infos)
    found = partition(
        profile,
        draft.num_stages,
        memory_cap_bytes=options.memory_cap_bytes,
        schedule=draft.schedule,
        micro_batches=draft.micro_batches,
        weights=draft.weights,
    )
    return found.balance


def _check_profile(
    path: str, profile: Profile, draft: PipelineConfig, infos: list[LayerInfo], model_name: str
) -> None:
    """Refuse a ``--profile`` of another model, batch or input shape than this run's.

    ``model_name`` is the built model's own name, which a measured profile of a
    module:function model carries instead of the spec.
    """
    redo = "profile this run or drop --profile"
    if profile.model not in (draft.model, model_name):
        raise PipeswapError(
            f"{path} profiles {profile.model} but this run trains {draft.model}; {redo}"
        )
    if len(profile.layers) != len(infos):
        raise PipeswapError(
            f"{path} profiles {len(profile.layers)} layers but {draft.model} has "
            f"{len(infos)}: profile the same model or drop --profile"
        )
    for position, (theirs, info) in enumerate(zip(profile.layer_names, infos, strict=True)):
        if theirs != info.name:
            raise PipeswapError(
                f"{path} names layer {position} {theirs!r} but {draft.model}'s layer "
                f"{position} is {info.name!r}: profile the same model or drop --profile"
            )
    if profile.batch != draft.batch:
        raise PipeswapError(
            f"{path} profiles batch {profile.batch} but this run has --batch {draft.batch}; {redo}"
        )
    check_profile_shape(path, profile, draft.seq_len, draft.image_size)


def run_pipeline(config: TrainConfig) -> PipelineResult | None:
    """Run a resolved pipeline config: emulated here, or one rank per stage.

    Returns the combined result on rank 0 (and in the emulator), None on other ranks.
    """
    pipeline = pipeline_config(config)
    assert config.pipeline is not None and config.device is not None
    # The emulator and the runtime read each other's checkpoints: one identity for both.
    checkpoint, resume = checkpointing(
        config,
        pipeline.num_stages,
        balance=list(pipeline.balance),
        schedule=pipeline.schedule,
        weights=pipeline.weights,
        distances=pipeline.distances,
        lr_warmup=pipeline.lr_warmup,
        micro_batches=pipeline.micro_batches,
    )
    if config.pipeline.emulate:
        from pipeswap.pipeline.emulator import Emulator

        emulator = Emulator(pipeline, record=True, checkpoint=checkpoint, resume=resume)
        return emulator.run(progress=config.progress)
    env = torchrun_env()
    if env is not None and config.nproc is None and env.world_size != pipeline.num_stages:
        raise PipeswapError(
            f"torchrun started {env.world_size} ranks for --pipeline {pipeline.num_stages}: "
            f"use --nproc-per-node {pipeline.num_stages}"
        )
    nproc = None if env is not None and config.nproc is None else pipeline.num_stages
    return run_ranks(
        _stage_rank,
        nproc,
        pipeline,
        config.device,
        config.progress,
        checkpoint,
        resume,
        device=config.device,
        timeout_s=config.timeout_s,
        stop_grace_s=5.0 if checkpoint is None else config.timeout_s + 30.0,
    )


def _stage_rank(
    rank: int,
    world: int,
    pipeline: PipelineConfig,
    device: str,
    progress: bool,
    checkpoint: CheckpointPlan | None,
    resume: tuple[str, int] | None,
) -> PipelineResult | None:
    from pipeswap.pipeline.runtime import run_rank

    where = rank_device(device, local_rank_of(rank))
    if where.type == "cuda":
        torch.cuda.set_device(where)
    return run_rank(pipeline, device=where, progress=progress, checkpoint=checkpoint, resume=resume)


def report(config: TrainConfig, result: PipelineResult) -> dict[str, Any]:
    """The ``pipeswap.train/2`` report of a pipeline run (runtime or emulator)."""
    out = base_report(
        config,
        losses=result.losses,
        params_sha256=result.params_sha256,
        nproc=1 if result.mode == "emulate" else result.config.num_stages,
    )
    out.update(result.to_report())
    return out
