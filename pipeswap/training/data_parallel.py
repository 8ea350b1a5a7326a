"""Data-parallel training with swapping: profile and plan on rank 0, train every rank, report.

Rank 0 profiles the model on its own device (or reads ``profile_path``), plans with the
simulator on the topology and sends the plan to every rank; all ranks train under
DDP (pipeswap.dist.ddp) and rank 0 builds the report. The default topology is this
machine's calibration for the run's ranks and device when ``pipeswap topology calibrate``
made one, else the one detected on a CUDA machine; on the CPU the preset ``switch-4`` (four
GPUs behind one PCIe switch) with the plan using its first ``nproc`` GPUs
(``single-root-8`` for 5 to 8 ranks).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from typing import Any

import torch

from pipeswap.config_fields import ConfigError, require
from pipeswap.dist.env import local_rank_of
from pipeswap.dist.group import all_gather, broadcast_from_rank0, rank_device
from pipeswap.dist.launch import run_ranks
from pipeswap.dist.signals import LauncherInterrupted
from pipeswap.dist.threads import thread_share
from pipeswap.errors import PipeswapError
from pipeswap.hardware.calibration import found_calibration
from pipeswap.hardware.detect import detect_topology, named_topology
from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import Topology
from pipeswap.metrics import HeldOutSums, StepLog
from pipeswap.models.base import LayeredModel
from pipeswap.models.registry import model_spec
from pipeswap.models.state import untouched
from pipeswap.pipeline.resolve import check_profile_shape
from pipeswap.precision import autocast, autocast_dtype
from pipeswap.profiling.measure import measure
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.step import dtype_name
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.planner import make_plan
from pipeswap.swap.runtime.learning import learnt_by
from pipeswap.swap.runtime.recompute_sizes import measure_recomputation
from pipeswap.train_config import TrainConfig
from pipeswap.training.dp_rank import train_rank
from pipeswap.training.dp_result import RankResult, measured_step_s
from pipeswap.training.job import ModelJob, job_for
from pipeswap.training.report import DataParallelDetails, TrainReport
from pipeswap.training.resume import agree_on_run, checkpointing
from pipeswap.training.seq2seq_job import Seq2SeqJob

__all__ = [
    "PlanPayload",
    "data_parallel_rank",
    "default_topology",
    "report",
    "swap_topology",
    "train_data_parallel",
]


@dataclass(frozen=True)
class PlanPayload:
    """What rank 0 sends every rank before training: the plan, the profile it was made
    from, and the simulator's numbers for the report (or the error that stops every rank)."""

    plan: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    topology: str = ""
    predicted_step_s: float = 0.0
    lower_bound_s: float = 0.0
    error: str | None = None
    calibrated: bool = False  # planned on this machine's calibration (a basis to predict)


def default_topology(device: str, nproc: int) -> Topology:
    """The topology to plan for when none is named (see the module docstring): this
    machine's calibration for ``nproc`` ranks on ``device`` when one was made
    (pipeswap topology calibrate), else the detected GPUs, else a preset."""
    calibrated = found_calibration(device, nproc)
    if calibrated is not None:
        return calibrated
    if device == "cuda":
        found = detect_topology()
        if found is not None:
            return found
    if nproc <= 4:
        return preset("switch-4")
    if nproc <= 8:
        return preset("single-root-8")
    raise ConfigError(f"no preset has {nproc} GPUs; pass {{topology}} FILE describing {nproc} GPUs")


def _topology(config: TrainConfig, nproc: int) -> Topology:
    assert config.device is not None
    return swap_topology(config.topology, config.device, nproc)


def swap_topology(name: str | None, device: str, nproc: int) -> Topology:
    """The topology a swap plan for ``nproc`` ranks on ``device`` is made for: ``name``
    (a preset, a file, or ``detect``), else :func:`default_topology`."""
    if name is None:
        return default_topology(device, nproc)
    return named_topology(name)


def _profile(config: TrainConfig, job: ModelJob | Seq2SeqJob, device: torch.device) -> Profile:
    if isinstance(job, Seq2SeqJob):  # no LayeredModel: profiled as a loop is
        with autocast(config.precision, device):
            return job.profile(device, config.optim.name)
    if config.profile_path is not None:
        profile = Profile.load(config.profile_path)
        mine = (job.model, job.batch_size, job.dtype)
        theirs = (profile.model, profile.batch, profile.dtype)
        require(
            mine == theirs,
            f"{config.profile_path} profiles (model, batch, dtype) = {theirs}, but this run is "
            f"{mine}; profile this run or drop {{profile_path}}",
        )
        check_profile_shape(config.profile_path, profile, job.seq_len, job.image_size)
        _check_profile_precision(config.profile_path, profile, config.precision)
        require(
            profile.optimizer == config.optim.name,
            f"{config.profile_path} profiles optimizer {profile.optimizer}, whose state the "
            f"plan would count, but this run's is {config.optim.name}: profile with "
            f"--optimizer {config.optim.name}, or drop {{profile_path}}",
        )
        return profile
    # The profile sees what autocast saves (half the bytes of float32 in bf16).
    with autocast(config.precision, device):
        profile = measure(
            job.model,
            job.batch_size,
            seq_len=job.seq_len,
            image_size=job.image_size,
            device=device,
            dtype=job.dtype,
            optimizer=config.optim.name,
            # Within the memory of a plan that swaps everything, where a plan will swap:
            # the step as it is may not fit the GPU the budget is for.
            saved_on_host=learnt_by(config.require_swap().policy) == "on-host",
        )
        return _with_recompute_sizes(profile, job, device)


def _with_recompute_sizes(profile: Profile, job: ModelJob, device: torch.device) -> Profile:
    """``profile`` with what recomputing each layer keeps and saves again, measured as the
    runtime recomputes (the loss after the head keeps its log-probabilities)."""
    model = job.build(device)
    model.train()
    if not isinstance(model, LayeredModel) or list(model.layer_names) != profile.layer_names:
        return profile
    inputs, targets = (t.to(device) for t in job.batch(0))
    children = dict(model.named_children())
    layers = {name: children[name] for name in model.layer_names}
    with untouched(model):
        sizes = measure_recomputation(
            model, layers, list(layers), lambda: job.loss(model, model(inputs), targets)
        )
    return replace(
        profile,
        layers=tuple(
            replace(layer, **sizes.profile_fields(layer.name, layer.forward_s))
            for layer in profile.layers
        ),
    )


def _check_profile_precision(path: str, profile: Profile, precision: str) -> None:
    """Refuse a profile measured in another precision than the run's (its saved bytes
    differ: autocast saves half-precision copies)."""
    dtype = autocast_dtype(precision)
    mine = None if dtype is None else dtype_name(dtype)
    theirs = profile.notes.get("autocast")
    require(
        mine == theirs,
        f"{path} was profiled with autocast {theirs or 'off'}, but this run's {{precision}} "
        f"is {precision}; profile it with --precision {precision} (pipeswap profile), or "
        "drop {profile_path} to measure here",
    )


def _plan(config: TrainConfig, world_size: int, device: torch.device) -> PlanPayload:
    """Rank 0's work before training: profile, plan."""
    profile = _profile(config, job_for(config), device)
    topology = _topology(config, world_size)
    slowdown = (topology.calibration or {}).get("compute_slowdown")
    if slowdown and world_size > 1:
        # Measured by rank 0 alone; in the run every rank computes at once (calibrated).
        profile = profile.slowed(float(slowdown), f"{slowdown:.2f}x: {world_size} ranks at once")
    if profile.memory is not None:
        # Held through every step beyond what the profiled one held: DDP's flat bucket per
        # gradient, and (accumulating) the gradients of the micro-batches before.
        held = profile.param_bytes * ((world_size > 1) + (config.optim.accumulate > 1))
        profile = replace(profile, memory=profile.memory.moved(held))
    result = make_plan(
        profile,
        topology,
        config.require_swap(),
        gpus=world_size,
        sync_every=config.optim.accumulate,
    ).runnable()
    return PlanPayload(
        plan=result.plan.to_json(),
        profile=profile.to_json(),
        topology=topology.name,
        predicted_step_s=result.iteration_s,
        lower_bound_s=result.lower_bound_s,
        calibrated=topology.calibration is not None,
    )


def data_parallel_rank(
    rank: int,
    world_size: int,
    config: TrainConfig,
    local_rank: int | None = None,
    threads: int | None = None,
) -> TrainReport | None:
    """One rank of a run: plan on rank 0, train everywhere; rank 0 returns the report.
    ``threads``: this rank's CPU threads (default: its share, pipeswap.dist.threads)."""
    assert config.device is not None
    device = rank_device(config.device, rank if local_rank is None else local_rank)
    if device.type == "cuda":
        # Before the first collective: NCCL runs object collectives on the current device.
        torch.cuda.set_device(device)
    checkpoint, resume = checkpointing(config, world_size, sync_every=config.optim.accumulate)
    checkpoint = agree_on_run(checkpoint, world_size)
    payload: PlanPayload | None = None
    if rank == 0:
        try:
            payload = _plan(config, world_size, device)
        except ConfigError as exc:
            payload = PlanPayload(error=exc.message)
        except PipeswapError as exc:
            payload = PlanPayload(error=str(exc))
    payload = broadcast_from_rank0(payload, world_size, patient=True)  # rank 0 plans
    assert payload is not None
    if payload.error is not None:
        raise ConfigError(payload.error)
    assert payload.plan is not None and payload.profile is not None
    plan = SwapPlan.from_json(payload.plan)
    with StepLog(config.log, config.steps, enabled=rank == 0) as log:
        result = train_rank(
            job_for(config),
            plan,
            config,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            profile=Profile.from_json(payload.profile),
            checkpoint=checkpoint,
            resume=resume,
            log=log,
            threads=threads,
        )
        results = all_gather(result, world_size)
        if rank != 0:
            return None
        done = report(config, plan, payload, results)
        log.close(done.data_parallel.eval if done.data_parallel else None)
        return done


def _rank_entry(
    rank: int, world_size: int, config: TrainConfig, threads: int | None
) -> TrainReport | None:
    return data_parallel_rank(rank, world_size, config, local_rank_of(rank), threads)


def train_data_parallel(config: TrainConfig) -> TrainReport | None:
    """Train a resolved data-parallel config on ``config.nproc`` ranks; rank 0's report."""
    job_for(config)  # refuse what cannot train before any rank starts
    assert config.device is not None
    try:
        # A signal gives the ranks time to finish their step (and write a checkpoint).
        report: TrainReport | None = run_ranks(
            _rank_entry,
            config.nproc,
            config,
            # Shared out here: a started rank is a new process, which would not know of a
            # torch.set_num_threads this one made (under torchrun, each rank's own share).
            None if config.nproc is None else thread_share(config.nproc),
            device=config.device,
            timeout_s=config.timeout_s,
            stop_grace_s=config.timeout_s + 30.0,
        )
    except LauncherInterrupted as stopped:
        if not isinstance(stopped.value, TrainReport):
            raise
        report = stopped.value
        if report.stopped_by is not None:  # the ranks heard SIGTERM: name the launcher's
            report = replace(report, stopped_by=signal.Signals(stopped.signum).name)
    return report


# What the data-parallel keys mean, written into every report.
_NOTES = {
    "losses": "per step: the mean over ranks of each rank's mean micro-batch loss (each "
    "micro-batch weighted by its share of the labels every rank scores, where counts differ: "
    "the loss over the whole batch)",
    "losses_per_rank": "losses_per_rank[rank][step]: mean of the step's micro-batch "
    "losses on that rank (weighted as in losses)",
    "peak_resident_bytes": "per rank, what the device's own meter read (compare with "
    "budget_bytes): CUDA: torch.cuda.max_memory_allocated from the first training step on; "
    "CPU: the live storages (as torch's MemTracker counts them, the host pool left out) "
    "over the first step; peak_saved_bytes is the executor's ledger of saved tensors",
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
    "predicted_step_s": "the simulator's iteration time for the plan: a prediction for "
    "this machine only where calibrated is true (pipeswap topology calibrate)",
    "eval": "the held-out score after the last step: batches (every rank's, eval_batches "
    "each), the mean batch loss and, for classifiers, the accuracy",
}


def report(
    config: TrainConfig, plan: SwapPlan, payload: PlanPayload, results: list[RankResult]
) -> TrainReport:
    """The ``pipeswap.train/2`` report of a data-parallel run (per-rank lists in rank order)."""
    ordered = sorted(results, key=lambda r: r.rank)
    steps = len(ordered[0].losses)
    # Every rank trains an equal share of the mini-batch: the mean is the mini-batch loss.
    losses = [sum(r.losses[s] for r in ordered) / len(ordered) for s in range(steps)]
    # Every rank scored its own held-out batches: the report counts them all.
    held_out = HeldOutSums.total(r.held_out for r in ordered if r.held_out is not None)
    details = DataParallelDetails(
        policy=plan.policy,
        sync_every=config.optim.accumulate,
        losses_per_rank=[list(r.losses) for r in ordered],
        step_s=[list(r.step_s) for r in ordered],
        params_sha256_per_rank=[r.params_sha256 for r in ordered],
        buffers_sha256=ordered[0].buffers_sha256,
        peak_resident_bytes=[r.peak_resident_bytes for r in ordered],
        peak_saved_bytes=[r.peak_saved_bytes for r in ordered],
        budget_bytes=ordered[0].budget_bytes,
        saved_budget_bytes=[r.saved_budget_bytes for r in ordered],
        swapped_bytes=[r.swapped_bytes for r in ordered],
        recompute=[list(g.recompute) for g in plan.gpus],
        recomputed_layers=[r.recomputed_layers for r in ordered],
        recomputed_bytes=[r.recomputed_bytes for r in ordered],
        late_fetches=[r.late_fetches for r in ordered],
        offset_s=[r.offset_s for r in ordered],
        predicted_step_s=payload.predicted_step_s,
        measured_step_s=measured_step_s(ordered),
        lower_bound_s=payload.lower_bound_s,
        topology=payload.topology,
        gpus=[g.gpu for g in plan.gpus],
        dtype=job_for(config).dtype,
        plan=plan.to_json(),
        notes=_NOTES,
        eval=held_out.score(
            held_out.batches, classify=model_spec(config.model).task_entry.accuracy
        ),
    )
    return TrainReport.of(
        config,
        losses=losses,
        params_sha256=ordered[0].params_sha256,
        nproc=len(ordered),
        evals=[{"step": step, **score} for step, score in ordered[0].evals],
        data_parallel=details,
        stopped_by=ordered[0].stopped_by,
        calibrated=payload.calibrated,
    )
