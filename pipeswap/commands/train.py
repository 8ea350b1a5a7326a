"""`pipeswap train`: data-parallel training with tensor swapping, or pipelined (--pipeline K)."""

from __future__ import annotations

import argparse

from pipeswap.errors import PipeswapError

_EXAMPLES = """examples:
  pipeswap train --model gpt2-tiny --pipeline 4 --schedule async-1f1b --weights spectrain \\
      --steps 20 --nproc 4 --report r.json
  pipeswap train --model gpt2-tiny --pipeline 4 --schedule 1f1b --micro-batches 4 --emulate
  torchrun --nproc-per-node 4 -m pipeswap train --model gpt2-tiny --pipeline 4 --steps 20
  pipeswap train --model gpt2-tiny --batch 8 --seq-len 64 --steps 5 --nproc 2 \\
      --swap-policy disjoint --footprint-ratio 1.5 --report r.json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from pipeswap.pipeline.train import add_pipeline_arguments
    from pipeswap.swap.train_cli import add_swap_train_arguments

    parser = subparsers.add_parser(
        "train",
        help="train a model: data-parallel with swapping, or pipelined (--pipeline K)",
        description="Train a zoo model on the offline datasets and write a JSON report. "
        "Without --pipeline: data-parallel over --nproc ranks, saved activations swapped to "
        "host memory by a plan (--swap-policy) that keeps each GPU within its budget. With "
        "--pipeline K: the model is cut into K stages, one process per stage (or all in one "
        "with --emulate).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_training_arguments(parser)
    add_pipeline_arguments(parser)
    add_swap_train_arguments(parser)
    parser.set_defaults(func=run)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every kind of training shares."""
    parser.add_argument("--model", required=True, help="zoo model name (e.g. gpt2-tiny)")
    parser.add_argument("--batch", type=int, default=None, help="mini-batch size (default: zoo's)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (LMs)")
    shape.add_argument("--image-size", type=int, default=None, help="image side (image models)")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default 0.05 for sgd, 1e-3 for adam/adamw)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialization seed")
    parser.add_argument("--report", metavar="PATH", help="write the JSON report here")


def run(args: argparse.Namespace) -> int:
    if args.pipeline is None:
        from pipeswap.swap.train_cli import run_data_parallel

        return run_data_parallel(args)
    if args.swap_policy is not None:
        raise PipeswapError(
            "--swap-policy applies to data-parallel training; drop --pipeline to swap, or "
            "drop --swap-policy to train a pipeline"
        )
    from pipeswap.pipeline.train import run_pipeline

    return run_pipeline(args)
