"""Data-parallel training with swapping: profile and plan on rank 0, train every rank, report.

Rank 0 profiles the model on its own device (or reads ``profile_path``), plans with the
simulator on the topology and sends the plan to every rank; all ranks train under
DistributedDataParallel and rank 0 builds the report. The default topology is the one
detected on a CUDA machine; on the CPU it is the preset ``switch-4`` (four GPUs behind one
PCIe switch) with the plan using its first ``nproc`` GPUs (``single-root-8`` for 5 to 8
ranks).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pipeswap.dist.env import local_rank_of
from pipeswap.dist.group import all_gather, broadcast_from_rank0, rank_device
from pipeswap.dist.launch import run_ranks
from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import Topology
from pipeswap.profile import Profile
from pipeswap.swap.plan import SwapPlan
from pipeswap.training.config import TrainConfig
from pipeswap.training.dp_rank import RankResult, TrainSettings, ZooJob, measured_step_s, train_rank
from pipeswap.training.report import base_report
from pipeswap.training.resume import checkpointing


def job_of(config: TrainConfig) -> ZooJob:
    """What a resolved config trains: the model (zoo, directory, module:function) and its data."""
    assert config.batch is not None
    return ZooJob(
        config.model,
        config.batch,
        seq_len=config.seq_len,
        image_size=config.image_size,
        seed=config.seed,
    )


def settings_of(config: TrainConfig) -> TrainSettings:
    """The per-rank loop's settings from a resolved config."""
    assert config.lr is not None and config.device is not None
    settings = TrainSettings(
        steps=config.steps,
        sync_every=config.swap_options.sync_every,
        optimizer=config.optimizer,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        device=config.device,
        progress=config.progress,
    )
    settings.check()
    return settings


def default_topology(device: str, nproc: int) -> Topology:
    """The topology to plan for when none is named (see the module docstring)."""
    from pipeswap.hardware.presets import preset

    if device == "cuda":
        from pipeswap.hardware.detect import detect_topology

        found = detect_topology()
        if found is not None:
            return found
    if nproc <= 4:
        return preset("switch-4")
    if nproc <= 8:
        return preset("single-root-8")
    raise PipeswapError(f"no preset has {nproc} GPUs; pass --topology FILE describing {nproc} GPUs")


def _topology(config: TrainConfig, nproc: int) -> Topology:
    name = config.swap_options.topology
    if name is None:
        assert config.device is not None
        return default_topology(config.device, nproc)
    if name == "detect":
        from pipeswap.hardware.detect import detect_topology

        found = detect_topology()
        if found is None:
            raise PipeswapError(
                "--topology detect found no NVIDIA GPU here; name a preset (switch-4, "
                "single-root-8, dual-root-8, direct-4) or a topology JSON file"
            )
        return found
    from pipeswap.hardware.presets import resolve_topology

    return resolve_topology(name)


def _profile(config: TrainConfig, job: ZooJob, device: torch.device) -> Profile:
    if config.profile_path is not None:
        profile = Profile.load(config.profile_path)
        mine = (job.model, job.batch_size, job.dtype)
        theirs = (profile.model, profile.batch, profile.dtype)
        if mine != theirs:
            raise PipeswapError(
                f"{config.profile_path} profiles (model, batch, dtype) = {theirs}, but this "
                f"run is {mine}; profile this run or drop --profile"
            )
        check_profile_shape(config.profile_path, profile, job.seq_len, job.image_size)
        return profile
    from pipeswap.profiling import measure

    return measure(
        job.model,
        job.batch_size,
        seq_len=job.seq_len,
        image_size=job.image_size,
        device=device,
        dtype=job.dtype,
        optimizer=config.optimizer,
    )


def check_profile_shape(
    path: str, profile: Profile, seq_len: int | None, image_size: int | None
) -> None:
    """Refuse a profile made at another sequence length or image size than this run's.

    A side the profile or the run leaves unset (None) is not compared.
    """
    for key, flag, mine in (
        ("seq_len", "--seq-len", seq_len),
        ("image_size", "--image-size", image_size),
    ):
        theirs = getattr(profile, key)
        if theirs is not None and mine is not None and theirs != mine:
            raise PipeswapError(
                f"{path} profiles {key} {theirs} but this run has {flag} {mine}; "
                "profile this run or drop --profile"
            )


def _plan(config: TrainConfig, world_size: int, device: torch.device) -> dict[str, Any]:
    """Rank 0's work before training: profile, plan. Returns what every rank needs."""
    from pipeswap.swap.planner import make_plan

    options = config.swap_options
    profile = _profile(config, job_of(config), device)
    topology = _topology(config, world_size)
    result = make_plan(
        profile,
        topology,
        policy=options.policy,
        gpus=world_size,
        gpu_memory_bytes=options.gpu_memory_bytes,
        footprint_ratio=options.footprint_ratio,
        sync_every=options.sync_every,
        time_limit_s=options.time_limit_s,
    )
    return {
        "plan": result.plan.to_json(),
        "profile": profile.to_json(),
        "topology": topology.name,
        "predicted_step_s": result.iteration_s,
        "lower_bound_s": result.lower_bound_s,
    }


def run_rank(
    rank: int, world_size: int, config: TrainConfig, local_rank: int | None = None
) -> dict[str, Any] | None:
    """One rank of a run: plan on rank 0, train everywhere; rank 0 returns the report."""
    assert config.device is not None
    device = rank_device(config.device, rank if local_rank is None else local_rank)
    if device.type == "cuda":
        # Before the first collective: NCCL runs object collectives on the current device.
        torch.cuda.set_device(device)
    checkpoint, resume = checkpointing(
        config, world_size, sync_every=config.swap_options.sync_every
    )
    payload: dict[str, Any] | None = None
    if rank == 0:
        try:
            payload = _plan(config, world_size, device)
        except PipeswapError as exc:
            payload = {"error": str(exc)}
    payload = broadcast_from_rank0(payload, world_size)
    assert payload is not None
    if "error" in payload:
        raise PipeswapError(payload["error"])
    plan = SwapPlan.from_json(payload["plan"])
    profile = Profile.from_json(payload["profile"])
    settings = replace(settings_of(config), progress=config.progress and rank == 0)
    result = train_rank(
        job_of(config),
        plan,
        settings,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        profile=profile,
        checkpoint=checkpoint,
        resume=resume,
    )
    results = all_gather(result, world_size)
    return report(config, plan, payload, results) if rank == 0 else None


def _rank_entry(rank: int, world_size: int, config: TrainConfig) -> dict[str, Any] | None:
    return run_rank(rank, world_size, config, local_rank_of(rank))


def train_data_parallel(config: TrainConfig) -> dict[str, Any] | None:
    """Train a resolved data-parallel config on ``config.nproc`` ranks; rank 0's report."""
    job_of(config)  # refuse what cannot train before any rank starts
    assert config.device is not None
    # With checkpoints, SIGTERM gives the ranks time to finish their step and write one.
    grace = config.timeout_s + 30.0 if config.checkpoint_target is not None else 5.0
    return run_ranks(
        _rank_entry,
        config.nproc,
        config,
        device=config.device,
        timeout_s=config.timeout_s,
        stop_grace_s=grace,
    )


def report(
    config: TrainConfig, plan: SwapPlan, payload: dict[str, Any], results: list[RankResult]
) -> dict[str, Any]:
    """The ``pipeswap.train/2`` report of a data-parallel run (per-rank lists in rank order)."""
    ordered = sorted(results, key=lambda r: r.rank)
    steps = len(ordered[0].losses)
    # Every rank trains an equal share of the mini-batch: the mean is the mini-batch loss.
    losses = [sum(r.losses[s] for r in ordered) / len(ordered) for s in range(steps)]
    out = base_report(
        config, losses=losses, params_sha256=ordered[0].params_sha256, nproc=len(ordered)
    )
    out.update(
        {
            "policy": plan.policy,
            "sync_every": config.swap_options.sync_every,
            "losses_per_rank": [list(r.losses) for r in ordered],
            "step_s": [list(r.step_s) for r in ordered],
            "params_sha256_per_rank": [r.params_sha256 for r in ordered],
            "buffers_sha256": ordered[0].buffers_sha256,
            "peak_resident_bytes": [r.peak_resident_bytes for r in ordered],
            "peak_saved_bytes": [r.peak_saved_bytes for r in ordered],
            "budget_bytes": ordered[0].budget_bytes,
            "saved_budget_bytes": [r.saved_budget_bytes for r in ordered],
            "swapped_bytes": [r.swapped_bytes for r in ordered],
            "recompute": [list(g.recompute) for g in plan.gpus],
            "recomputed_layers": [r.recomputed_layers for r in ordered],
            "recomputed_bytes": [r.recomputed_bytes for r in ordered],
            "late_fetches": [r.late_fetches for r in ordered],
            "offset_s": [r.offset_s for r in ordered],
            "predicted_step_s": payload["predicted_step_s"],
            "measured_step_s": measured_step_s(ordered),
            "lower_bound_s": payload["lower_bound_s"],
            "topology": payload["topology"],
            "gpus": [g.gpu for g in plan.gpus],
            "dtype": job_of(config).dtype,
            "plan": plan.to_json(),
            "notes": {
                "losses": "per step: the mean over ranks of each rank's mean micro-batch loss",
                "losses_per_rank": "losses_per_rank[rank][step]: mean of the step's micro-batch "
                "losses on that rank",
                "peak_resident_bytes": "per rank; CPU: most bytes of saved tensors held on the "
                "device (executor accounting); CUDA: torch.cuda.max_memory_allocated",
                "saved_budget_bytes": "budget_bytes minus parameters, gradients and optimizer "
                "state (the profile's resident bytes): what saved tensors may use",
                "buffers_sha256": "rank 0's buffers (BatchNorm statistics), digested as "
                "params_sha256 digests parameters",
                "swapped_bytes": "per rank, bytes sent to host memory in one iteration",
                "recompute": "per rank, the layers the plan recomputes (forward run again right "
                "before their backward)",
                "recomputed_layers": "per rank, layer forwards run again in one iteration (one "
                "per recomputed layer and micro-batch)",
                "recomputed_bytes": "per rank, bytes of saved tensors those re-runs made in one "
                "iteration (held from the re-run to the end of the layer's backward)",
                "measured_step_s": "median over steps after the first of the slowest rank's step",
                "predicted_step_s": "the simulator's iteration time for the plan",
            },
        }
    )
    return out
