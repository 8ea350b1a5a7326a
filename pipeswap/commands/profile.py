"""`pipeswap profile`: measure or estimate one model's per-layer costs and write a Profile."""

from __future__ import annotations

import argparse
import sys

from pipeswap.commands.json_out import print_json
from pipeswap.commands.options import add_options, given
from pipeswap.commands.settings import Outputs
from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import gpu_spec
from pipeswap.jsonio import check_writable
from pipeswap.models import model_spec
from pipeswap.optim import PROFILE_OPTIMIZER, OptimizerConfig
from pipeswap.precision import DEFAULT_PRECISION, autocast
from pipeswap.profiling.estimate import estimate
from pipeswap.profiling.measure import measure
from pipeswap.profiling.profile_config import DEFAULT_GPU, ProfileConfig
from pipeswap.profiling.table import fit_warning, format_profile
from pipeswap.train_config import TrainConfig

__all__ = ["register", "run"]

_EXAMPLES = """examples:
  pipeswap profile --model gpt2-tiny --batch 8 --device cpu --out gpt2-tiny.json
  pipeswap profile --model gpt2-xl --batch 4 --estimate --gpu v100-32gb --out xl.json
  pipeswap profile --model gpt2-small --batch 64 --device cuda --saved-on-host --out big.json
"""


_DEVICE_HELP = "measure on this device (default cpu)"
_OPT_HELP = (
    f"whose state the profile counts (default {PROFILE_OPTIMIZER}; sgd means SGD with "
    "momentum, state 1x params; adam(w): 2x)"
)
_OUT_HELPS = {
    "out": "where to write the profile JSON",
    "json": "print the profile JSON, no table",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure (cpu/cuda) or estimate (meta + GPU spec) per-layer costs of a model",
        description="Profile one training step of a model layer by layer: forward and "
        "backward time, parameter, saved-tensor and output bytes. Writes a "
        "pipeswap.profile/1 JSON file and prints a table.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, TrainConfig, only=("model", "batch"), required=("model",))
    shape = parser.add_mutually_exclusive_group()
    add_options(shape, TrainConfig, only=("seq_len", "image_size"))
    where = parser.add_mutually_exclusive_group()
    add_options(where, TrainConfig, only=("device",), helps={"device": _DEVICE_HELP})
    add_options(where, ProfileConfig, only=("estimate",))
    add_options(parser, ProfileConfig, only=("gpu",))
    add_options(parser, TrainConfig, only=("precision",))
    add_options(parser, OptimizerConfig, only=("optimizer",), helps={"optimizer": _OPT_HELP})
    add_options(parser, ProfileConfig, only=("warmup", "repeats", "saved_on_host"))
    add_options(parser, Outputs, only=("out", "json"), required=("out",), helps=_OUT_HELPS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _check_counts(args)
    source = ProfileConfig(**given(args, ProfileConfig))
    _check_out(args.out)
    spec = model_spec(args.model)  # unknown names: PipeswapError listing the zoo and the forms
    spec.task_entry.check_sizes(
        args.model, args.seq_len, args.image_size, tokens=bool(spec.reads_tokens)
    )
    estimating = source.estimate is not None
    if source.estimate not in (None, "", args.model):
        raise PipeswapError(
            f"--estimate {source.estimate} and --model {args.model} name two models; write "
            f"--model {args.model} --estimate (or --model {source.estimate} --estimate)"
        )
    if source.gpu is not None and not estimating:
        raise PipeswapError("--gpu applies to --estimate; add --estimate or drop --gpu")
    if source.saved_on_host and estimating:
        raise PipeswapError(
            "--saved-on-host applies to a measured profile (an estimate holds no memory); "
            "drop --estimate or --saved-on-host"
        )
    precision = args.precision or DEFAULT_PRECISION
    if estimating and precision != DEFAULT_PRECISION:
        raise PipeswapError(
            f"--estimate cannot see what autocast casts in --precision {precision} (the meta "
            "device does not autocast): measure it (drop --estimate)"
        )
    batch = spec.default_batch if args.batch is None else args.batch
    optimizer = args.optimizer or PROFILE_OPTIMIZER
    gpu = None
    try:
        if estimating:
            gpu = gpu_spec(source.gpu or DEFAULT_GPU)
            profile = estimate(
                args.model,
                batch,
                seq_len=args.seq_len,
                image_size=args.image_size,
                gpu=gpu,
                optimizer=optimizer,
            )
        else:
            with autocast(precision, args.device or "cpu"):
                profile = measure(
                    args.model,
                    batch,
                    seq_len=args.seq_len,
                    image_size=args.image_size,
                    device=args.device or "cpu",
                    optimizer=optimizer,
                    warmup=source.warmup,
                    repeats=source.repeats,
                    saved_on_host=source.saved_on_host,
                )
    except RuntimeError as exc:
        # VGG's max-pools halve the image once per stage; torch refuses an image they
        # shrink below one pixel. Only the model knows its minimum, so name the default.
        if args.image_size is None or "Output size is too small" not in str(exc):
            raise
        raise PipeswapError(
            f"--image-size {args.image_size} is too small for {args.model}: its pooling "
            f"shrinks the image below one pixel; use a larger --image-size (the model's "
            f"default is {spec.default_image_size})"
        ) from None
    profile.save(args.out)
    if args.json:
        print_json(profile.to_json())
    else:
        print(format_profile(profile, gpu))
        print(f"wrote {args.out}")
    warning = fit_warning(profile, gpu) if gpu is not None else None
    if warning is not None:
        print(f"pipeswap profile: {warning}", file=sys.stderr)
    return 0


def _check_out(path: str) -> None:
    """Refuse an --out that cannot be written before profiling, not after it."""

    if path == "":
        raise PipeswapError("--out is empty; give a file name")
    check_writable(path)


def _check_counts(args: argparse.Namespace) -> None:
    """Refuse sizes and counts argparse's int() lets through but no model can run with.

    Without this, --seq-len 0 wrote a profile of empty sequences and --seq-len -4 failed
    inside torch with a traceback.
    """
    least = (
        ("--batch", args.batch, 1),
        ("--seq-len", args.seq_len, 1),
        ("--image-size", args.image_size, 1),
    )
    for flag, value, minimum in least:
        if value is not None and value < minimum:
            raise PipeswapError(
                f"{flag} is {value}; use a whole number >= {minimum} (or leave it out for the "
                "model's default)"
            )
