"""`pipeswap train`: parse once into a TrainConfig, train in its mode, print and write the report."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.optim import OPTIMIZERS
from pipeswap.pipeline.config import WEIGHT_MODES
from pipeswap.pipeline.partition import read_balance
from pipeswap.pipeline.predict import DISTANCE_RULES
from pipeswap.pipeline.schedule import SCHEDULE_NAMES
from pipeswap.swap.planner import DEFAULT_TIME_LIMIT_S, POLICIES

_EXAMPLES = """examples:
  pipeswap train --model gpt2-tiny --batch 8 --seq-len 64 --steps 5 --nproc 2 \\
      --swap-policy disjoint --footprint-ratio 1.5 --report r.json
  pipeswap train --model gpt2-tiny --pipeline 4 --schedule async-1f1b --weights spectrain \\
      --steps 20 --nproc 4 --report r.json
  pipeswap train --model gpt2-tiny --pipeline 4 --schedule 1f1b --micro-batches 4 --emulate
  torchrun --nproc-per-node 4 -m pipeswap train --model gpt2-tiny --pipeline 4 --steps 20
"""

# Which mode an option belongs to: None for every mode.
DATA_PARALLEL = "data-parallel"
PIPELINE = "pipeline"


@dataclass(frozen=True)
class _Option:
    flags: tuple[str, ...]
    group: str
    mode: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


_GROUPS = {
    "model": "what to train",
    "optimizer": "optimizer",
    "run": "where and how long",
    "output": "output",
    DATA_PARALLEL: "data parallelism with swapping (the default mode)",
    PIPELINE: "pipeline parallelism (--pipeline K)",
}

# Mode-specific options default to None (or False) so that giving one in the other mode
# can be told apart from not giving it, and refused.
OPTIONS = (
    _Option(
        ("--model",),
        "model",
        None,
        dict(
            required=True,
            help="zoo model name (e.g. gpt2-tiny), a local Hugging Face "
            "model directory, or module:function returning an nn.Module",
        ),
    ),
    _Option(
        ("--batch",), "model", None, dict(type=int, help="mini-batch per rank (default: the zoo's)")
    ),
    _Option(("--seq-len",), "model", None, dict(type=int, help="tokens per sequence (LMs)")),
    _Option(("--image-size",), "model", None, dict(type=int, help="image side (image models)")),
    _Option(
        ("--seed",),
        "model",
        None,
        dict(type=int, default=0, help="weight and data seed (default 0)"),
    ),
    _Option(
        ("--profile",),
        "model",
        None,
        dict(
            metavar="PATH",
            help="a profile JSON: data parallel plans from it (default: "
            "measure here); a pipeline balances its stages with it (default: FLOP counts)",
        ),
    ),
    _Option(("--optimizer",), "optimizer", None, dict(choices=OPTIMIZERS, default="sgd")),
    _Option(
        ("--lr",),
        "optimizer",
        None,
        dict(type=float, help="learning rate (default 0.05 for sgd, 1e-3 for adam/adamw)"),
    ),
    _Option(
        ("--momentum",),
        "optimizer",
        None,
        dict(type=float, default=0.9, help="SGD momentum (default 0.9)"),
    ),
    _Option(("--weight-decay",), "optimizer", None, dict(type=float, default=0.0)),
    _Option(
        ("--steps",), "run", None, dict(type=int, default=20, help="optimizer steps (default 20)")
    ),
    _Option(
        ("--nproc",),
        "run",
        None,
        dict(type=int, help="start this many local ranks (a pipeline: one per stage)"),
    ),
    _Option(
        ("--device",),
        "run",
        None,
        dict(
            choices=("cpu", "cuda"),
            help="where to train: cpu uses gloo, cuda NCCL (gloo "
            "when ranks share a GPU); default cuda when available for data parallelism, "
            "cpu for pipelines",
        ),
    ),
    _Option(
        ("--timeout",),
        "run",
        None,
        dict(
            type=float,
            default=60.0,
            help="seconds a rank waits for a peer before failing (default 60)",
        ),
    ),
    _Option(
        ("--report",),
        "output",
        None,
        dict(metavar="PATH", help="write the pipeswap.train/2 JSON report here"),
    ),
    _Option(
        ("--checkpoint-dir",),
        "output",
        None,
        dict(
            metavar="DIR",
            help="write checkpoints here (every --checkpoint-every steps, "
            "and on SIGTERM in data-parallel runs)",
        ),
    ),
    _Option(
        ("--checkpoint-every",),
        "output",
        None,
        dict(
            type=int,
            default=0,
            metavar="N",
            help="steps between checkpoints (default 0: only on SIGTERM)",
        ),
    ),
    _Option(
        ("--resume",),
        "output",
        None,
        dict(metavar="DIR", help="continue from the newest complete checkpoint in DIR"),
    ),
    _Option(
        ("--swap-policy",),
        DATA_PARALLEL,
        DATA_PARALLEL,
        dict(
            choices=POLICIES, help="which saved tensors go to host memory, and when (default auto)"
        ),
    ),
    _Option(
        ("--sync-every",),
        DATA_PARALLEL,
        DATA_PARALLEL,
        dict(type=int, metavar="K", help="micro-batches per gradient all-reduce (default 1)"),
    ),
    _Option(
        ("--gpu-memory",),
        DATA_PARALLEL,
        DATA_PARALLEL,
        dict(metavar="SIZE", help="memory budget per GPU, e.g. 16GiB (default: the topology's)"),
    ),
    _Option(
        ("--footprint-ratio",),
        DATA_PARALLEL,
        DATA_PARALLEL,
        dict(type=float, metavar="R", help="budget = the no-swap peak divided by R (e.g. 1.5)"),
    ),
    _Option(
        ("--topology",),
        DATA_PARALLEL,
        DATA_PARALLEL,
        dict(
            metavar="NAME|FILE|detect",
            help="GPUs and PCIe links to plan for (default: "
            "detected on CUDA, preset switch-4 on the CPU)",
        ),
    ),
    _Option(
        ("--time-limit",),
        DATA_PARALLEL,
        DATA_PARALLEL,
        dict(
            type=float,
            metavar="S",
            help=f"MIP solver time limit in seconds (default {DEFAULT_TIME_LIMIT_S:g})",
        ),
    ),
    _Option(
        ("--pipeline",),
        PIPELINE,
        None,
        dict(type=int, metavar="K", help="cut the model into K stages"),
    ),
    _Option(
        ("--balance",),
        PIPELINE,
        PIPELINE,
        dict(help="layers per stage, e.g. 3,3,2,2 (default: partitioner)"),
    ),
    _Option(("--schedule",), PIPELINE, PIPELINE, dict(choices=SCHEDULE_NAMES, help="default 1f1b")),
    _Option(
        ("--weights",),
        PIPELINE,
        PIPELINE,
        dict(choices=WEIGHT_MODES, help="weight versions for async-1f1b (default stale)"),
    ),
    _Option(
        ("--distances",),
        PIPELINE,
        PIPELINE,
        dict(
            choices=DISTANCE_RULES,
            help="version distances for spectrain/predict-adam: "
            "walked from the schedule (default) or the official SpecTrain table",
        ),
    ),
    _Option(
        ("--lr-warmup",),
        PIPELINE,
        PIPELINE,
        dict(
            type=int,
            metavar="STEPS",
            help="ramp the learning rate linearly over the "
            "first STEPS mini-batches, in every schedule and mode (default 0: constant)",
        ),
    ),
    _Option(
        ("--micro-batches",),
        PIPELINE,
        PIPELINE,
        dict(type=int, help="units per mini-batch for gpipe/1f1b (default K; async: 1)"),
    ),
    _Option(
        ("--eval-batches",), PIPELINE, PIPELINE, dict(type=int, help="held-out batches (default 2)")
    ),
    _Option(
        ("--memory-cap",),
        PIPELINE,
        PIPELINE,
        dict(
            metavar="BYTES",
            help="per-stage memory cap for the partitioner, e.g. 8GiB (needs --profile)",
        ),
    ),
    _Option(
        ("--error-feedback",),
        PIPELINE,
        PIPELINE,
        dict(
            action="store_true",
            default=None,
            help="the error-feedback correction of "
            "delayed gradients (arXiv 2606.30634); not available yet, see docs",
        ),
    ),
    _Option(
        ("--emulate",),
        PIPELINE,
        PIPELINE,
        dict(
            action="store_true",
            default=None,
            help="run every stage in this process (bit-identical on CPU)",
        ),
    ),
    _Option(
        ("--trace",),
        PIPELINE,
        PIPELINE,
        dict(metavar="PATH", help="write a Chrome trace of the pipeline's passes"),
    ),
)

_EXCLUSIVE = (("--seq-len", "--image-size"), ("--gpu-memory", "--footprint-ratio"))


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
    """Every option of `pipeswap train`, in one table, grouped by the mode it belongs to."""
    groups: dict[str, Any] = {key: parser.add_argument_group(t) for key, t in _GROUPS.items()}
    by_flag = {option.flags[0]: option for option in OPTIONS}
    exclusive: dict[str, Any] = {}
    for pair in _EXCLUSIVE:
        group = groups[by_flag[pair[0]].group].add_mutually_exclusive_group()
        exclusive.update(dict.fromkeys(pair, group))
    for option in OPTIONS:
        target = exclusive.get(option.flags[0], groups[option.group])
        target.add_argument(*option.flags, **option.kwargs)


def refuse_other_mode(args: argparse.Namespace) -> None:
    """Refuse options of the mode this run is not in, naming the mode they belong to."""
    mode = PIPELINE if args.pipeline is not None else DATA_PARALLEL
    for option in OPTIONS:
        if option.mode is None or option.mode == mode:
            continue
        if getattr(args, option.dest) is None:
            continue
        if option.mode == PIPELINE:
            raise PipeswapError(
                f"{option.flags[0]} applies to pipeline training (--pipeline K); add "
                f"--pipeline K, or drop {option.flags[0]} to train data-parallel"
            )
        raise PipeswapError(
            f"{option.flags[0]} applies to data-parallel training; drop --pipeline to swap, "
            f"or drop {option.flags[0]} to train a pipeline"
        )


def config_from_args(args: argparse.Namespace) -> Any:
    """The one TrainConfig the parsed options describe (defaults left to ``resolved()``)."""
    from pipeswap.training.config import PipelineOptions, SwapOptions, TrainConfig
    from pipeswap.units import parse_bytes

    refuse_other_mode(args)
    swap = pipeline = None
    if args.pipeline is None:
        swap = SwapOptions(
            policy=args.swap_policy or "auto",
            sync_every=1 if args.sync_every is None else args.sync_every,
            gpu_memory_bytes=None if args.gpu_memory is None else parse_bytes(args.gpu_memory),
            footprint_ratio=args.footprint_ratio,
            topology=args.topology,
            time_limit_s=DEFAULT_TIME_LIMIT_S if args.time_limit is None else args.time_limit,
        )
    else:
        balance = None if args.balance is None else read_balance(args.balance)
        pipeline = PipelineOptions(
            stages=args.pipeline,
            balance=balance,
            schedule=args.schedule or "1f1b",
            weights=args.weights or "stale",
            distances=args.distances or "schedule",
            lr_warmup=args.lr_warmup or 0,
            micro_batches=args.micro_batches,
            eval_batches=2 if args.eval_batches is None else args.eval_batches,
            memory_cap_bytes=None if args.memory_cap is None else parse_bytes(args.memory_cap),
            emulate=bool(args.emulate),
            error_feedback=bool(args.error_feedback),
        )
    return TrainConfig(
        model=args.model,
        batch=args.batch,
        seq_len=args.seq_len,
        image_size=args.image_size,
        steps=args.steps,
        seed=args.seed,
        optimizer=args.optimizer,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        device=args.device,
        nproc=args.nproc,
        timeout_s=args.timeout,
        profile_path=args.profile,
        swap=swap,
        pipeline=pipeline,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )


def run(args: argparse.Namespace) -> int:
    from pipeswap.training import train
    from pipeswap.training.report import write_report

    config = config_from_args(args)
    _check_outputs(args)
    outcome = train(config)
    if outcome is None:  # torchrun: another rank reports
        return 0
    report = outcome.report
    for line in summary_lines(report):
        print(line)
    if args.report:
        write_report(args.report, report)
        print(f"report written to {args.report}")
    if args.trace:
        from pipeswap.pipeline.chrome import dump_chrome_trace

        dump_chrome_trace(
            args.trace, list(outcome.timeline), title=report["model"], seconds_per_unit=1.0
        )
        print(f"trace written to {args.trace}")
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse an unwritable --report or --trace before training, not after it."""
    from pipeswap.jsonio import check_writable

    if args.report is not None:
        check_writable(args.report, inputs=(args.profile,), outputs=(args.trace,))
    if args.trace is not None:
        check_writable(args.trace, inputs=(args.profile,))


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What `pipeswap train` prints about a finished run, from its report."""
    from pipeswap.units import format_bytes

    losses = report["losses"]
    if report["mode"] == DATA_PARALLEL:
        swapped = ", ".join(format_bytes(b) for b in report["swapped_bytes"])
        return [
            f"pipeswap train: {report['model']} x{report['nproc']} ranks, policy "
            f"{report['policy']}: budget {format_bytes(report['budget_bytes'])}/GPU, swapped "
            f"{swapped} per step; step {report['measured_step_s'] * 1e3:.1f} ms measured, "
            f"{report['predicted_step_s'] * 1e3:.1f} ms predicted",
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; params sha256 {report['params_sha256']}",
        ]
    config = report["config"]
    busy = " ".join(f"{b:.0%}" for b in report["stage_busy"])
    evaluation = ", ".join(f"{k} {v:.4g}" for k, v in report["eval"].items() if k != "batches")
    lines = [
        f"pipeswap train: {config['model']}, {len(config['balance'])} stages (balance "
        f"{','.join(map(str, config['balance']))}), {config['schedule']}/{config['weights']}, "
        f"{config['optimizer']} lr {config['lr']}, {config['steps']} steps of {config['batch']} "
        f"({report['mode']})"
        + (f", lr warm-up {config['lr_warmup']} steps" if config["lr_warmup"] else "")
        + (f", {config['distances']} distances" if config["distances"] != "schedule" else ""),
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out {evaluation}; "
        f"{report['samples_per_s']:.1f} samples/s; stage busy {busy}",
    ]
    if "prediction_error" in report:
        parts = [
            f"{e['stage']}: F {_fmt(e['forward'])} B {_fmt(e['backward'])}"
            for e in report["prediction_error"]
        ]
        lines.append("prediction error ||W_hat-W_future||/||W_now-W_future|| " + "; ".join(parts))
    lines.append(f"params sha256 {report['params_sha256']}")
    return lines


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
