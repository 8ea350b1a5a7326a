"""`pipeswap train` for data-parallel runs with swapping: profile here, plan, train, report.

    pipeswap train --model gpt2-tiny --batch 8 --seq-len 64 --steps 5 --nproc 2 \\
        --swap-policy disjoint --footprint-ratio 1.5 --report r.json
    torchrun --nproc-per-node 2 -m pipeswap train --model gpt2-tiny --swap-policy auto ...

Rank 0 profiles the model on its own device (or reads ``--profile``), plans with the
simulator on ``--topology`` and sends the plan to every rank; all ranks train under
DistributedDataParallel and rank 0 writes the report. The default topology is the one
detected on a CUDA machine; on the CPU it is the preset ``switch-4`` (four GPUs behind one
PCIe switch) with the plan using its first ``--nproc`` GPUs (``single-root-8`` for 5 to 8
ranks).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import Topology
from pipeswap.jsonio import dump_json
from pipeswap.profile import Profile
from pipeswap.swap.dp import (
    RankResult,
    TrainSettings,
    ZooJob,
    backend_for,
    build_report,
    train_rank,
)
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.planner import DEFAULT_TIME_LIMIT_S, POLICIES
from pipeswap.units import format_bytes, parse_bytes


def _has(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def add_swap_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the data-parallel swapping options; options the parser already has are kept.

    So it can extend a parser that already has the shared training options (``--model``,
    ``--batch``, ``--nproc``, ``--device``...) or build a complete one on its own.
    """
    if not _has(parser, "--model"):
        parser.add_argument("--model", required=True, help="zoo model name (e.g. gpt2-tiny)")
    if not _has(parser, "--batch"):
        parser.add_argument("--batch", type=int, default=None,
                            help="micro-batch per rank (default: the zoo's)")  # fmt: skip
    if not _has(parser, "--seq-len") and not _has(parser, "--image-size"):
        shape = parser.add_mutually_exclusive_group()
        shape.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (LMs)")
        shape.add_argument("--image-size", type=int, default=None, help="image side (image models)")
    shared: list[tuple[str, dict[str, Any]]] = [
        ("--steps", dict(type=int, default=20, help="optimizer steps (default 20)")),
        ("--seed", dict(type=int, default=0, help="weight and data seed (default 0)")),
        ("--report", dict(metavar="PATH", help="write the JSON report here")),
        ("--optimizer", dict(choices=("sgd", "adam", "adamw"), default="sgd")),
        ("--lr", dict(type=float, default=None,
                      help="learning rate (default 0.05 for sgd, 1e-3 for adam/adamw)")),
        ("--momentum", dict(type=float, default=0.9, help="SGD momentum (default 0.9)")),
        ("--nproc", dict(type=int, default=None, help="start this many local ranks")),
        ("--device", dict(choices=("cpu", "cuda"), default=None,
                          help="where to train (default: cuda when available)")),
        ("--timeout", dict(type=float, default=60.0,
                           help="seconds a rank waits for a peer before failing (default 60)")),
        ("--profile", dict(metavar="PATH", help="a profile JSON to plan from (default: measure)")),
    ]  # fmt: skip
    for option, options in shared:
        if not _has(parser, option):
            parser.add_argument(option, **options)
    group = parser.add_argument_group("data-parallel swapping")
    group.add_argument("--swap-policy", choices=POLICIES, default=None,
                       help="which saved tensors go to host memory, and when (default auto)")
    group.add_argument("--sync-every", type=int, default=1, metavar="K",
                       help="micro-batches per gradient all-reduce (default 1)")
    budget = group.add_mutually_exclusive_group()
    budget.add_argument("--gpu-memory", metavar="SIZE",
                        help="memory budget per GPU, e.g. 16GiB (default: the topology's)")
    budget.add_argument("--footprint-ratio", type=float, metavar="R",
                        help="budget = the no-swap peak divided by R (e.g. 1.5)")
    group.add_argument("--topology", metavar="NAME|FILE|detect", default=None,
                       help="GPUs and PCIe links to plan for (default: detected on CUDA, "
                       "preset switch-4 on the CPU)")
    group.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, metavar="S",
                       help="MIP solver time limit in seconds (default 60)")  # fmt: skip


@dataclass(frozen=True)
class _Request:
    """Everything a rank needs, checked once in the launching process."""

    job: ZooJob
    settings: TrainSettings
    policy: str
    gpu_memory_bytes: int | None
    footprint_ratio: float | None
    topology: str | None
    time_limit_s: float
    profile_path: str | None
    report_path: str | None
    timeout_s: float


def _request(args: argparse.Namespace) -> _Request:
    from pipeswap.models import model_spec
    from pipeswap.profiling.measure import shape_defaults

    spec = model_spec(args.model)
    seq_len, image_size = shape_defaults(args.model, args.seq_len, args.image_size)
    batch = args.batch or spec.default_batch
    if batch < 1:
        raise PipeswapError(f"--batch is {batch}; use 1 or more")
    optimizer = args.optimizer or "sgd"
    lr = args.lr if args.lr is not None else (0.05 if optimizer == "sgd" else 1e-3)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = TrainSettings(
        steps=args.steps, sync_every=args.sync_every, optimizer=optimizer, lr=lr,
        momentum=args.momentum, device=device, progress=True,
    )  # fmt: skip
    settings.check()
    gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else None
    return _Request(
        job=ZooJob(args.model, batch, seq_len=seq_len, image_size=image_size, seed=args.seed),
        settings=settings,
        policy=args.swap_policy or "auto",
        gpu_memory_bytes=gpu_memory,
        footprint_ratio=args.footprint_ratio,
        topology=args.topology,
        time_limit_s=args.time_limit,
        profile_path=args.profile,
        report_path=args.report,
        timeout_s=args.timeout,
    )


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
    raise PipeswapError(
        f"no preset has {nproc} GPUs; pass --topology FILE describing {nproc} GPUs"
    )


def _topology(request: _Request, nproc: int) -> Topology:
    name = request.topology
    if name is None:
        return default_topology(request.settings.device, nproc)
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


def _profile(request: _Request, device: torch.device) -> Profile:
    job = request.job
    if request.profile_path is not None:
        profile = Profile.load(request.profile_path)
        mine = (job.model, job.batch_size, job.dtype)
        theirs = (profile.model, profile.batch, profile.dtype)
        if mine != theirs:
            raise PipeswapError(
                f"{request.profile_path} profiles (model, batch, dtype) = {theirs}, but this "
                f"run is {mine}; profile this run or drop --profile"
            )
        return profile
    from pipeswap.profiling import measure

    return measure(
        job.model, job.batch_size, seq_len=job.seq_len, image_size=job.image_size,
        device=device, dtype=job.dtype, optimizer=request.settings.optimizer,
    )  # fmt: skip


def _plan(request: _Request, world_size: int, device: torch.device) -> dict[str, Any]:
    """Rank 0's work before training: profile, plan. Returns what every rank needs."""
    from pipeswap.swap.planner import make_plan

    profile = _profile(request, device)
    topology = _topology(request, world_size)
    result = make_plan(
        profile, topology, policy=request.policy, gpus=world_size,
        gpu_memory_bytes=request.gpu_memory_bytes, footprint_ratio=request.footprint_ratio,
        sync_every=request.settings.sync_every, time_limit_s=request.time_limit_s,
    )  # fmt: skip
    return {
        "plan": result.plan.to_json(),
        "profile": profile.to_json(),
        "topology": topology.name,
        "predicted_step_s": result.iteration_s,
        "lower_bound_s": result.lower_bound_s,
    }


def _share(payload: dict[str, Any] | None, rank: int, world_size: int) -> dict[str, Any]:
    if world_size > 1:
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    assert payload is not None
    if "error" in payload:
        raise PipeswapError(payload["error"])
    return payload


def run_rank(rank: int, world_size: int, request: _Request, local_rank: int | None = None) -> int:
    """One rank of a run: plan on rank 0, train everywhere, report from rank 0."""
    from pipeswap.swap.dp import rank_device

    device = rank_device(request.settings.device, rank if local_rank is None else local_rank)
    if device.type == "cuda":
        # Before the first collective: NCCL runs object collectives on the current device.
        torch.cuda.set_device(device)
    payload: dict[str, Any] | None = None
    if rank == 0:
        try:
            payload = _plan(request, world_size, device)
        except PipeswapError as exc:
            payload = {"error": str(exc)}
    payload = _share(payload, rank, world_size)
    plan = SwapPlan.from_json(payload["plan"])
    profile = Profile.from_json(payload["profile"])
    settings = replace(request.settings, progress=request.settings.progress and rank == 0)
    result = train_rank(
        request.job, plan, settings, rank=rank, world_size=world_size,
        local_rank=local_rank, profile=profile,
    )  # fmt: skip
    results: list[Any] = [result]
    if world_size > 1:
        results = [None] * world_size
        dist.all_gather_object(results, result)
    if rank == 0:
        _finish(request, plan, payload, results)
    return 0


def _finish(
    request: _Request, plan: SwapPlan, payload: dict[str, Any], results: list[RankResult]
) -> None:
    job = request.job
    report = build_report(
        results, plan, request.settings, predicted_step_s=payload["predicted_step_s"],
        extra={
            "batch": job.batch_size, "seq_len": job.seq_len, "image_size": job.image_size,
            "dtype": job.dtype, "seed": job.seed, "topology": payload["topology"],
            "gpus": [g.gpu for g in plan.gpus], "lower_bound_s": payload["lower_bound_s"],
            "plan": plan.to_json(),
        },
    )  # fmt: skip
    if request.report_path:
        dump_json(request.report_path, report)
    swapped = ", ".join(format_bytes(b) for b in report["swapped_bytes"])
    print(
        f"{plan.model} x{len(results)} ranks, policy {plan.policy}: budget "
        f"{format_bytes(report['budget_bytes'])}/GPU, swapped {swapped} per step; "
        f"step {report['measured_step_s'] * 1e3:.1f} ms measured, "
        f"{report['predicted_step_s'] * 1e3:.1f} ms predicted; final loss "
        f"{report['losses'][0][-1]:.4f}"
        + (f"; report: {request.report_path}" if request.report_path else "")
    )


def _spawned_rank(rank: int, world_size: int, request: _Request) -> int:
    return run_rank(rank, world_size, request)


def run_data_parallel(args: argparse.Namespace) -> int:
    """`pipeswap train` without --pipeline: data-parallel training with swapping."""
    from pipeswap.pipeline.launch import init_process_group, spawn, torchrun_env

    request = _request(args)
    env = torchrun_env()
    if env is not None and args.nproc is None:
        # NCCL needs a GPU per rank on each machine: count this machine's ranks.
        backend = backend_for(request.settings.device, env.local_world_size or env.world_size)
        init_process_group(env, backend=backend, timeout_s=request.timeout_s)
        try:
            return run_rank(env.rank, env.world_size, request, env.local_rank)
        finally:
            dist.destroy_process_group()
    nproc = args.nproc or 1
    if nproc < 1:
        raise PipeswapError(f"--nproc is {nproc}; use 1 or more")
    if nproc == 1:
        return run_rank(0, 1, request)
    launched = spawn(
        _spawned_rank, nproc, request,
        backend=backend_for(request.settings.device, nproc), timeout_s=request.timeout_s,
    )  # fmt: skip
    if launched.ok:
        return 0
    for rank, code in enumerate(launched.exit_codes):
        if code != 0:
            state = "was killed" if rank in launched.killed else f"exited with {code}"
            print(f"pipeswap train: rank {rank} {state}", file=sys.stderr)
    return 2 if 2 in launched.exit_codes else 1
