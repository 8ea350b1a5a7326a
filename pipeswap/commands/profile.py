"""`pipeswap profile`: measure or estimate one model's per-layer costs and write a Profile."""

from __future__ import annotations

import argparse
import json
import sys

from pipeswap.commands.options import add_options
from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import gpu_spec
from pipeswap.jsonio import check_writable
from pipeswap.models import model_spec
from pipeswap.precision import DEFAULT_PRECISION, autocast
from pipeswap.profiling import estimate, fit_warning, format_profile, measure
from pipeswap.train_config import TrainConfig

_EXAMPLES = """examples:
  pipeswap profile --model gpt2-tiny --batch 8 --device cpu --out gpt2-tiny.json
  pipeswap profile --model gpt2-xl --batch 4 --estimate --gpu v100-32gb --out xl.json
"""


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
    parser.add_argument(
        "--model",
        required=True,
        help="zoo model name (e.g. gpt2-tiny), a local "
        "Hugging Face model directory, or module:function returning an nn.Module",
    )
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (LMs)")
    shape.add_argument("--image-size", type=int, default=None, help="image side (image models)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="measure on this device (default cpu)",
    )
    where.add_argument(
        "--estimate",
        action="store_true",
        help="estimate on the meta device for --gpu instead of running",
    )
    parser.add_argument("--gpu", default=None, help="GPU spec for --estimate (default v100-32gb)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_options(parser, TrainConfig, only=("precision",))
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "adam", "adamw"),
        default="sgd",
        help="sgd means SGD with momentum (state: 1x params; adam(w): 2x)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps (measure only)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps; median reported")
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    parser.add_argument("--json", action="store_true", help="print the profile JSON, no table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    _check_counts(args)
    _check_out(args.out)
    spec = model_spec(args.model)  # unknown names: PipeswapError listing the zoo and the forms
    spec.task_entry.check_sizes(args.model, args.seq_len, args.image_size)
    if args.gpu is not None and not args.estimate:
        raise PipeswapError("--gpu applies to --estimate; add --estimate or drop --gpu")
    precision = args.precision or DEFAULT_PRECISION
    if args.estimate and precision != DEFAULT_PRECISION:
        raise PipeswapError(
            f"--estimate cannot see what autocast casts in --precision {precision} (the meta "
            "device does not autocast): measure it (drop --estimate), or estimate pure "
            "half precision with --dtype bfloat16"
        )
    batch = spec.default_batch if args.batch is None else args.batch
    gpu = None
    try:
        if args.estimate:
            gpu = gpu_spec(args.gpu or "v100-32gb")
            profile = estimate(
                args.model,
                batch,
                seq_len=args.seq_len,
                image_size=args.image_size,
                gpu=gpu,
                dtype=args.dtype,
                optimizer=args.optimizer,
            )
        else:
            with autocast(precision, args.device or "cpu"):
                profile = measure(
                    args.model,
                    batch,
                    seq_len=args.seq_len,
                    image_size=args.image_size,
                    device=args.device or "cpu",
                    dtype=args.dtype,
                    optimizer=args.optimizer,
                    warmup=args.warmup,
                    repeats=args.repeats,
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
        print(json.dumps(profile.to_json(), indent=1))
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
        ("--repeats", args.repeats, 1),
        ("--warmup", args.warmup, 0),
    )
    for flag, value, minimum in least:
        if value is not None and value < minimum:
            hint = (
                ""
                if flag in ("--repeats", "--warmup")
                else (" (or leave it out for the model's default)")
            )
            raise PipeswapError(f"{flag} is {value}; use a whole number >= {minimum}{hint}")
