"""`pipeswap train --pipeline K`: resolve the config, run ranks or the emulator, write the report.

Launch commands (CPU, gloo):

    pipeswap train --model gpt2-tiny --pipeline 4 --schedule async-1f1b --weights spectrain \
        --steps 20 --nproc 4 --report r.json
    torchrun --nproc-per-node 4 -m pipeswap train --model gpt2-tiny --pipeline 4 ...
    pipeswap train --model gpt2-tiny --pipeline 4 ... --emulate      # one process, same bits
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import dump_json
from pipeswap.pipeline.chrome import dump_chrome_trace
from pipeswap.pipeline.config import WEIGHT_MODES, PipelineConfig
from pipeswap.pipeline.launch import init_process_group, spawn, torchrun_env
from pipeswap.pipeline.partition import parse_balance, partition
from pipeswap.pipeline.predict import DISTANCE_RULES
from pipeswap.pipeline.result import PipelineResult
from pipeswap.pipeline.schedule import SCHEDULE_NAMES
from pipeswap.pipeline.stage import flop_profile, inspect_layers

DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of pipelined training (``--pipeline`` and everything that goes with it)."""
    group = parser.add_argument_group("pipeline parallelism")
    group.add_argument("--pipeline", type=int, metavar="K", help="cut the model into K stages")
    group.add_argument("--balance", help="layers per stage, e.g. 3,3,2,2 (default: partitioner)")
    group.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b")
    group.add_argument("--weights", choices=WEIGHT_MODES, default="stale",
                       help="weight versions for async-1f1b (default stale)")  # fmt: skip
    group.add_argument("--distances", choices=DISTANCE_RULES, default="schedule",
                       help="version distances for spectrain/predict-adam: walked from the "
                       "schedule (default) or the official SpecTrain table")  # fmt: skip
    group.add_argument("--lr-warmup", type=int, default=0, metavar="STEPS",
                       help="ramp the learning rate linearly over the first STEPS mini-batches, "
                       "in every schedule and mode (default 0: constant)")  # fmt: skip
    group.add_argument("--micro-batches", type=int, default=None,
                       help="units per mini-batch for gpipe/1f1b (default K; async: 1)")  # fmt: skip
    group.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--eval-batches", type=int, default=2, help="held-out batches (default 2)")
    group.add_argument("--profile", metavar="PATH",
                       help="profile JSON for the partitioner (default: FLOP counts)")  # fmt: skip
    group.add_argument("--memory-cap", metavar="BYTES",
                       help="per-stage memory cap for the partitioner, e.g. 8GiB (needs --profile)")  # fmt: skip
    group.add_argument("--nproc", type=int, help="start this many local ranks (must equal K)")
    group.add_argument("--emulate", action="store_true",
                       help="run every stage in this process (bit-identical on CPU)")  # fmt: skip
    group.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="cpu uses gloo, cuda uses NCCL (one GPU per rank); a pipeline "
                       "defaults to cpu")  # fmt: skip
    group.add_argument("--timeout", type=float, default=60.0,
                       help="seconds a rank waits for a peer before failing (default 60)")  # fmt: skip
    group.add_argument("--trace", metavar="PATH", help="write a Chrome trace of the run")


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The PipelineConfig the arguments ask for, with defaults and the balance resolved."""
    seq_len, image_size, batch = args.seq_len, args.image_size, args.batch
    if ":" not in args.model:
        from pipeswap.models import model_spec

        spec = model_spec(args.model)
        if spec.task == "lm" and image_size is not None:
            raise PipeswapError(
                f"{args.model} is a language model: pass --seq-len, not --image-size"
            )
        if spec.task == "classify" and seq_len is not None:
            raise PipeswapError(f"{args.model} is an image model: pass --image-size, not --seq-len")
        if spec.task == "lm" and seq_len is None:
            seq_len = spec.default_seq_len
        if spec.task == "classify" and image_size is None:
            image_size = spec.default_image_size
        batch = spec.default_batch if batch is None else batch
    stages = args.pipeline
    if args.nproc is not None and args.nproc != stages:
        raise PipeswapError(
            f"--nproc {args.nproc} does not match --pipeline {stages}: one rank per stage"
        )
    micro = args.micro_batches
    if micro is None:
        micro = 1 if args.schedule == "async-1f1b" else stages
    optimizer = args.optimizer
    draft = PipelineConfig(
        model=args.model,
        balance=(1,) * stages,
        schedule=args.schedule,
        weights=args.weights,
        optimizer=optimizer,
        lr=DEFAULT_LR[optimizer] if args.lr is None else args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        batch=batch or 8,
        micro_batches=micro,
        steps=args.steps,
        seq_len=seq_len,
        image_size=image_size,
        seed=args.seed,
        eval_batches=args.eval_batches,
        timeout_s=args.timeout,
        distances=args.distances,
        lr_warmup=args.lr_warmup,
    )
    draft.check()
    infos = inspect_layers(draft)
    if args.balance:
        balance = parse_balance(args.balance, len(infos), stages)
    else:
        balance = _partition(args, draft, infos)
    return dataclasses.replace(draft, balance=balance)


def _partition(args: argparse.Namespace, draft: PipelineConfig, infos: list) -> tuple[int, ...]:
    from pipeswap.profile import Profile
    from pipeswap.units import parse_bytes

    if args.profile:
        profile = Profile.load(args.profile)
        if len(profile.layers) != len(infos):
            raise PipeswapError(
                f"{args.profile} profiles {len(profile.layers)} layers but {draft.model} has "
                f"{len(infos)}: profile the same model"
            )
    else:
        if args.memory_cap:
            raise PipeswapError("--memory-cap needs --profile (a measured or estimated profile)")
        profile = flop_profile(draft, infos)
    cap = parse_bytes(args.memory_cap) if args.memory_cap else None
    found = partition(
        profile,
        draft.num_stages,
        memory_cap_bytes=cap,
        schedule=draft.schedule,
        micro_batches=draft.micro_batches,
        weights=draft.weights,
    )
    return found.balance


def run_pipeline(args: argparse.Namespace) -> int:
    """Pipelined training from parsed CLI arguments; returns the exit status."""
    config = config_from_args(args)
    args.device = args.device or "cpu"
    env = torchrun_env()
    if args.emulate:
        from pipeswap.pipeline.emulator import Emulator

        result: PipelineResult | None = Emulator(config, record=True).run(progress=True)
    elif env is not None and args.nproc is None:
        if env.world_size != config.num_stages:
            raise PipeswapError(
                f"torchrun started {env.world_size} ranks for --pipeline {config.num_stages}: "
                f"use --nproc-per-node {config.num_stages}"
            )
        result = _run_rank(env.rank, env.world_size, config, args.device, args.timeout, True)
    else:
        nproc = config.num_stages
        backend = "nccl" if args.device == "cuda" else "gloo"
        launched = spawn(
            _run_rank,
            nproc,
            config,
            args.device,
            args.timeout,
            False,
            backend=backend,
            timeout_s=args.timeout,
        )
        if not launched.ok:
            for rank, code in enumerate(launched.exit_codes):
                if code != 0:
                    state = "was killed" if rank in launched.killed else f"exited with {code}"
                    print(f"pipeswap train: rank {rank} {state}", file=sys.stderr)
            return 1
        result = launched.results[0]
    if result is not None:
        _finish(result, args)
    return 0


def _run_rank(
    rank: int, world: int, config: PipelineConfig, device: str, timeout: float, join: bool
) -> PipelineResult | None:
    from pipeswap.pipeline.runtime import run_rank

    env = torchrun_env()
    if join and env is not None:
        init_process_group(env, backend="nccl" if device == "cuda" else "gloo", timeout_s=timeout)
    where: Any = "cpu"
    if device == "cuda":
        local = env.local_rank if env is not None else rank
        torch.cuda.set_device(local)
        where = torch.device("cuda", local)
    return run_rank(config, device=where, progress=True)


def _finish(result: PipelineResult, args: argparse.Namespace) -> None:
    config = result.config
    busy = " ".join(f"{b:.0%}" for b in result.stage_busy)
    evaluation = ", ".join(f"{k} {v:.4g}" for k, v in result.eval.items() if k != "batches")
    print(
        f"pipeswap train: {config.model}, {config.num_stages} stages (balance "
        f"{','.join(map(str, config.balance))}), {config.schedule}/{config.weights}, "
        f"{config.optimizer} lr {config.lr}, {config.steps} steps of {config.batch} ({result.mode})"
        + (f", lr warm-up {config.lr_warmup} steps" if config.lr_warmup else "")
        + (f", {config.distances} distances" if config.distances != "schedule" else "")
    )
    print(
        f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; held-out {evaluation}; "
        f"{result.samples_per_s:.1f} samples/s; stage busy {busy}"
    )
    if result.prediction_error is not None:
        parts = [
            f"{k}: F {_fmt(e['forward'])} B {_fmt(e['backward'])}"
            for k, e in enumerate(result.prediction_error)
        ]
        print("prediction error ||W_hat-W_future||/||W_now-W_future|| " + "; ".join(parts))
    print(f"params sha256 {result.params_sha256}")
    if args.report:
        dump_json(args.report, result.to_report())
        print(f"report written to {args.report}")
    if args.trace:
        dump_chrome_trace(
            args.trace, list(result.timeline), title=config.model, seconds_per_unit=1.0
        )
        print(f"trace written to {args.trace}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
