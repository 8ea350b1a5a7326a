"""`pipeswap train`: parse once into a TrainConfig, train in its mode, print and write the report."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from pipeswap.checkpoint import CheckpointConfig
from pipeswap.commands.options import add_options, flag_of, given
from pipeswap.commands.settings import Outputs
from pipeswap.data_config import DataConfig
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_writable
from pipeswap.metrics import LogConfig
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.chrome import dump_chrome_trace
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.report import TrainReport, write_report
from pipeswap.training.run import TrainingStopped, train
from pipeswap.units import format_bytes

__all__ = [
    "DATA_PARALLEL",
    "PIPELINE",
    "STAGE_SWAP_FIELDS",
    "add_train_arguments",
    "config_from_args",
    "refuse_other_mode",
    "register",
    "run",
    "stage_swap_lines",
    "stopped_line",
    "summary_lines",
]

_EXAMPLES = """examples:
  pipeswap train --model gpt2-tiny --batch 8 --seq-len 64 --steps 5 --nproc 2 \\
      --swap-policy disjoint --footprint-ratio 1.5 --report r.json
  pipeswap train --model gpt2-tiny --pipeline 4 --schedule async-1f1b --weights spectrain \\
      --steps 20 --nproc 4 --report r.json
  pipeswap train --model gpt2-tiny --pipeline 4 --schedule 1f1b --micro-batches 4 --emulate
  torchrun --nproc-per-node 4 -m pipeswap train --model gpt2-tiny --pipeline 4 --steps 20
"""

DATA_PARALLEL = "data-parallel"
PIPELINE = "pipeline"
# The swap settings a pipeline's stages take (pipeswap.training.pipeline_stage_swaps).
STAGE_SWAP_FIELDS = ("policy", "gpu_memory_bytes", "footprint_ratio")

# The argument groups of --help, in order: (title, config class, its fields there or None).
_WHAT = ("model", "batch", "seq_len", "image_size", "seed", "profile_path")
_GROUPS: tuple[tuple[str, type, tuple[str, ...] | None], ...] = (
    ("what to train", TrainConfig, _WHAT),
    ("data", DataConfig, None),
    (
        "where and how long",
        TrainConfig,
        ("steps", "device", "precision", "nproc", "timeout_s", "topology"),
    ),
    ("optimizer", OptimizerConfig, None),
    ("checkpoints", CheckpointConfig, None),
    ("logging", LogConfig, None),
    ("swapping (data parallelism; a pipeline's stages: the first three)", SwapConfig, None),
    ("pipeline parallelism (--pipeline K)", PipelineConfig, None),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model: data-parallel with swapping, or pipelined (--pipeline K)",
        description="Train a model on the offline datasets and write a pipeswap.train/2 JSON "
        "report. Without --pipeline: data-parallel over --nproc ranks, saved activations "
        "swapped to host memory by a plan (--swap-policy) that keeps each GPU within its "
        "budget. With --pipeline K: the model is cut into K stages, one process per stage "
        "(or all in one with --emulate). An option of one mode is refused in the other.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    parser.set_defaults(func=run)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of `pipeswap train`: the fields of TrainConfig's tree, and the outputs."""
    for title, config, only in _GROUPS:
        add_options(parser.add_argument_group(title), config, only=only, required=("model",))
    add_options(
        parser.add_argument_group("output"),
        Outputs,
        only=("report", "trace"),
        helps={"trace": "write a Chrome trace of a pipeline's passes"},
    )


def refuse_other_mode(args: argparse.Namespace) -> None:
    """Refuse options of the mode this run is not in, naming the mode they belong to."""
    pipeline = args.stages is not None
    if not pipeline and args.trace is not None:
        raise PipeswapError(
            "--trace applies to pipeline training (--pipeline K); add --pipeline K, or drop "
            "--trace to train data-parallel"
        )
    if pipeline:
        others = [name for name in given(args, SwapConfig) if name not in STAGE_SWAP_FIELDS]
    else:
        others = list(given(args, PipelineConfig))
    for name in others:
        flag = flag_of(name)
        if pipeline:
            raise PipeswapError(
                f"{flag} applies to data-parallel training; drop {flag} (a pipeline's stages "
                "swap by --swap-policy, --gpu-memory or --footprint-ratio)"
            )
        raise PipeswapError(
            f"{flag} applies to pipeline training (--pipeline K); add --pipeline K, or drop "
            f"{flag} to train data-parallel"
        )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The one TrainConfig the parsed options describe (defaults are the configs' own)."""
    refuse_other_mode(args)
    pipeline = PipelineConfig(**given(args, PipelineConfig)) if args.stages is not None else None
    swap_settings = given(args, SwapConfig)
    # A pipeline's stages swap only when asked to (--swap-policy, --gpu-memory).
    swap = SwapConfig(**swap_settings) if pipeline is None or swap_settings else None
    return TrainConfig(
        **given(args, TrainConfig),
        optim=OptimizerConfig(**given(args, OptimizerConfig)),
        swap=swap,
        pipeline=pipeline,
        checkpoint=CheckpointConfig(**given(args, CheckpointConfig)),
        dataset=DataConfig(**given(args, DataConfig)),
        log=LogConfig(**given(args, LogConfig)),
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    _check_outputs(args, config)
    try:
        outcome = train(config)
    except TrainingStopped as stopped:  # after a step: report what ran
        outcome = stopped.outcome
    if outcome is None:  # torchrun: another rank reports
        return 0
    report = outcome.report
    for line in summary_lines(report):
        print(line)
    if config.checkpoint.save is not None and report.stopped_by is None:
        print(f"trained model written to {config.checkpoint.save}")
    if args.report:
        write_report(args.report, report)
        print(f"report written to {args.report}")
    if args.trace:
        dump_chrome_trace(
            args.trace, list(outcome.timeline), title=report.model, seconds_per_unit=1.0
        )
        print(f"trace written to {args.trace}")
    if report.stopped_by is not None:
        sys.stdout.flush()
        print(f"pipeswap train: {stopped_line(report, config)}", file=sys.stderr)
        return 128 + signal.Signals[report.stopped_by]
    return 0


def stopped_line(report: TrainReport, config: TrainConfig) -> str:
    """What a run a signal stopped did: its steps, and where its checkpoint is."""
    line = f"stopped by {report.stopped_by} after step {len(report.losses)} of {report.steps}"
    target = config.checkpoint.target
    if target is None:
        return line + " (--checkpoint-dir DIR would have kept a checkpoint to resume from)"
    return f"{line}; its checkpoint is in {target}: continue with --resume {target}"


def _check_outputs(args: argparse.Namespace, config: TrainConfig) -> None:
    """Refuse an unwritable --report, --trace or --metrics before training, not after it,
    and one that would write over what the run reads (its data, its model directory)."""
    outputs = (args.report, args.trace, args.metrics)
    data = config.dataset
    inputs = (args.profile_path, data.data, data.eval_data, config.model)
    for index, path in enumerate(outputs):
        if path is not None:
            others = outputs[:index] + outputs[index + 1 :]
            check_writable(
                path, inputs=[p for p in inputs if p and os.path.exists(p)], outputs=others
            )


def _held_out(score: dict[str, float | int]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in score.items() if k != "batches")


def _error(predicted: float, measured: float) -> str:
    """The prediction's error relative to the measurement, signed (+: predicted slower)."""
    if measured <= 0:
        return "no measurement"
    return f"{(predicted - measured) / measured:+.0%} off"


def _prediction(report: TrainReport, predicted: float, measured: float) -> str:
    """The predicted step beside the measured one, or why there is none: a simulation of a
    machine that was never measured (no calibration) is no prediction for this one."""
    if report.calibrated is False:
        return (
            "uncalibrated, so no prediction (`pipeswap topology calibrate --nproc "
            f"{report.nproc} --device {report.device}` measures this machine once for every "
            "later run)"
        )
    return f"{predicted * 1e3:.1f} ms predicted ({_error(predicted, measured)})"


def _measured_peak(peaks: list[int], budget: int) -> str:
    """The most a rank's device held by its own meter, beside the budget (-1: not read)."""
    read = [p for p in peaks if p >= 0]
    if not read:
        return ""
    most = max(read)
    over = f", {format_bytes(most - budget)} over it" if most > budget else ""
    return f" (measured peak {format_bytes(most)}{over})"


def summary_lines(report: TrainReport) -> list[str]:
    """What `pipeswap train` prints about a finished run, from its report."""
    losses = report.losses
    if report.data_parallel is not None:
        dp = report.data_parallel
        swapped = ", ".join(format_bytes(b) for b in dp.swapped_bytes)
        return [
            f"pipeswap train: {report.model} x{report.nproc} ranks, policy {dp.policy}: budget "
            f"{format_bytes(dp.budget_bytes)}/GPU{_measured_peak(dp.peak_resident_bytes, dp.budget_bytes)}, "
            f"swapped {swapped} per step; step "
            f"{dp.measured_step_s * 1e3:.1f} ms measured, "
            + _prediction(report, dp.predicted_step_s, dp.measured_step_s),
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f"; held-out {_held_out(dp.eval)}" if dp.eval and "loss" in dp.eval else "")
            + f"; params sha256 {report.params_sha256}",
        ]
    assert report.pipeline is not None
    pipe = report.pipeline
    config = pipe.config
    busy = " ".join(f"{b:.0%}" for b in pipe.stage_busy)
    replicas = int(config.get("replicas", 1))
    lines = [
        f"pipeswap train: {config['model']}, {len(config['balance'])} stages (balance "
        f"{','.join(map(str, config['balance']))})"
        + (f" x {replicas} replicas" if replicas > 1 else "")
        + f", {config['schedule']}/{config['weights']}, {config['optimizer']} lr "
        f"{config['lr']}, {config['steps']} steps of {config['batch']}"
        + (" per replica" if replicas > 1 else "")
        + f" ({report.mode})"
        + (f", lr warm-up {config['lr_warmup']} steps" if config["lr_warmup"] else "")
        + (
            f", {config['lr_schedule']} decay"
            if config.get("lr_schedule", "constant") != "constant"
            else ""
        )
        + (f", {config['distances']} distances" if config["distances"] != "schedule" else ""),
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out {_held_out(pipe.eval)}; "
        f"{pipe.samples_per_s:.1f} samples/s; stage busy {busy}",
    ]
    if pipe.predicted_step_s is not None and pipe.measured_step_s is not None:
        lines.append(
            f"step {pipe.measured_step_s * 1e3:.1f} ms measured, "
            + _prediction(report, pipe.predicted_step_s, pipe.measured_step_s)
        )
    if pipe.prediction_error is not None:
        parts = [
            f"{e['stage']}: F {_fmt(e['forward'])} B {_fmt(e['backward'])}"
            for e in pipe.prediction_error
        ]
        lines.append("prediction error ||W_hat-W_future||/||W_now-W_future|| " + "; ".join(parts))
    if pipe.stage_swap is not None:
        lines += stage_swap_lines(pipe.stage_swap)
    lines.append(f"params sha256 {report.params_sha256}")
    return lines


def stage_swap_lines(swap: dict[str, Any]) -> list[str]:
    """Per stage of a pipeline whose stages swap: its plan, and what it held at most."""
    lines = [f"stages swap ({swap['policy']}, budget {format_bytes(swap['budget_bytes'])}/GPU):"]
    stages = swap["stages"]
    for rank, measured in enumerate(swap["measured"]):
        if measured is None:
            continue
        plan = stages[rank % len(stages)]
        swapped = ",".join(measured["swapped_layers"]) or "-"
        recomputed = ",".join(measured["recomputed_layers"]) or "-"
        lines.append(
            f"  rank {rank} (stage {plan['stage']}): swaps {swapped} "
            f"({format_bytes(measured['unit_swap_bytes'])}/unit), recomputes {recomputed}; "
            f"saved tensors peak {format_bytes(measured['peak_saved_bytes'])} of "
            f"{format_bytes(plan['saved_budget_bytes'])} the budget leaves"
            + (f", {measured['late_fetches']} late fetches" if measured["late_fetches"] else "")
        )
    return lines


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
