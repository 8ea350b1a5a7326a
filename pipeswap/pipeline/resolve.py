"""A pipeline run made concrete: the model's defaults, the micro-batches and the stage balance."""

from __future__ import annotations

from dataclasses import replace

from pipeswap.config_fields import ConfigError, require
from pipeswap.pipeline.job import build_meta_model
from pipeswap.pipeline.stage import LayerInfo, flop_profile, inspect_layers
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.partition import check_balance, check_stage_count, partition
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig

__all__ = ["check_profile_layers", "check_profile_shape", "choose_balance", "resolve_pipeline"]


def resolve_pipeline(config: TrainConfig) -> TrainConfig:
    """``config`` resolved (:meth:`TrainConfig.resolved`) with its micro-batch count and its
    balance known: the given one checked against the model, else the partitioner's.
    Gradient accumulation over N batches becomes a mini-batch N times larger in N times
    the micro-batches (``accumulate`` 1 from there on: what runs is what the config says;
    the data source draws it as one batch of that size).

    Idempotent: every rank and the emulator call it on the same config and get the same
    balance (FLOP counts, or the profile at ``profile_path``; never timings of this run).
    """
    config = config.resolved()
    pipeline = config.require_pipeline()
    assert config.batch is not None
    if config.nproc is not None and pipeline.replicas == 1:
        # --nproc N with K stages: N / K replicas (TrainConfig checked that K divides N).
        pipeline = replace(pipeline, replicas=config.nproc // pipeline.num_stages)
    model = build_meta_model(config)
    # Before the batch split: too many stages is the real problem when K also sets it.
    check_stage_count(len(model), pipeline.num_stages, model.layer_names, config.model)
    micro_batches = pipeline.micro_batch_count
    if pipeline.micro_batches is not None:
        require(
            config.batch % micro_batches == 0,
            f"{{batch}} {config.batch} must split into {{micro_batches}} {micro_batches} equal "
            "parts: pick a batch that is a multiple of the micro-batch count",
        )
    require(
        config.batch % micro_batches == 0,
        f"{{batch}} {config.batch} does not split into the {micro_batches} micro-batches "
        f"{pipeline.schedule} uses by default (one per stage): pass {{micro_batches}} M with M "
        f"dividing {config.batch}, or a batch that is a multiple of {micro_batches}",
    )
    pipeline = replace(pipeline, micro_batches=micro_batches)
    config = replace(config, pipeline=pipeline)
    pipeline = choose_balance(config, inspect_layers(config), model.name)
    accumulate = config.optim.accumulate
    if accumulate > 1:
        assert config.batch is not None
        # N batches between updates: one mini-batch N times larger in N times the
        # micro-batches (as many samples per update; drawn as one batch, so other samples
        # than a data-parallel run's N batches of the same seed).
        return replace(
            config,
            batch=config.batch * accumulate,
            optim=replace(config.optim, accumulate=1),
            pipeline=replace(pipeline, micro_batches=micro_batches * accumulate),
        )
    return replace(config, pipeline=pipeline)


def choose_balance(config: TrainConfig, infos: list[LayerInfo], model_name: str) -> PipelineConfig:
    """``config``'s pipeline with its stages' balance: the given one checked against the
    layers, else the partitioner's (from the profile at ``profile_path``, or FLOP counts)."""
    pipeline = config.require_pipeline()
    if pipeline.balance is not None:
        names = [info.name for info in infos]
        balance = check_balance(pipeline.balance, len(infos), pipeline.num_stages, names)
    else:
        balance = _partition(config, infos, model_name)
    return replace(pipeline, stages=len(balance), balance=balance)


def _partition(config: TrainConfig, infos: list[LayerInfo], model_name: str) -> tuple[int, ...]:
    pipeline = config.require_pipeline()
    if config.profile_path is not None:
        profile = Profile.load(config.profile_path)
        check_profile_layers(config, profile, infos, model_name)
    else:
        profile = flop_profile(config, infos)
    found = partition(
        profile,
        pipeline.num_stages,
        memory_cap_bytes=pipeline.memory_cap_bytes,
        schedule=pipeline.schedule,
        micro_batches=pipeline.micro_batch_count,
        weights=pipeline.weights,
    )
    return found.balance


def check_profile_layers(
    config: TrainConfig, profile: Profile, infos: list[LayerInfo], model_name: str
) -> None:
    """Refuse a profile of another model, batch or input shape than this pipeline run's.

    ``model_name`` is the built model's own name, which a measured profile of a
    module:function model carries instead of the spec.
    """
    path, redo = config.profile_path, "profile this run or drop {profile_path}"
    require(
        profile.model in (config.model, model_name),
        f"{path} profiles {profile.model} but this run trains {config.model}; {redo}",
    )
    require(
        len(profile.layers) == len(infos),
        f"{path} profiles {len(profile.layers)} layers but {config.model} has {len(infos)}: "
        "profile the same model or drop {profile_path}",
    )
    for position, (theirs, info) in enumerate(zip(profile.layer_names, infos, strict=True)):
        require(
            theirs == info.name,
            f"{path} names layer {position} {theirs!r} but {config.model}'s layer {position} "
            f"is {info.name!r}: profile the same model or drop {{profile_path}}",
        )
    require(
        profile.batch == config.batch,
        f"{path} profiles batch {profile.batch} but this run has {{batch}} {config.batch}; " + redo,
    )
    check_profile_shape(str(path), profile, config.seq_len, config.image_size)


def check_profile_shape(
    path: str, profile: Profile, seq_len: int | None, image_size: int | None
) -> None:
    """Refuse a profile made at another sequence length or image size than this run's.

    A side the profile or the run leaves unset (None) is not compared.
    """
    for key, mine in (("seq_len", seq_len), ("image_size", image_size)):
        theirs = getattr(profile, key)
        if theirs is not None and mine is not None and theirs != mine:
            raise ConfigError(
                f"{path} profiles {key} {theirs} but this run has {{{key}}} {mine}; profile "
                "this run or drop {profile_path}"
            )
