"""`pipeswap export`: a checkpoint directory as the trained model, in the format it came in."""

from __future__ import annotations

import argparse

from pipeswap.commands.options import add_options
from pipeswap.commands.settings import Outputs
from pipeswap.train_config import TrainConfig
from pipeswap.training.export import export_checkpoint

__all__ = ["register", "run"]

_EXAMPLES = """examples:
  pipeswap train --model my-gpt2 --seq-len 64 --steps 1000 --checkpoint-dir ckpt --checkpoint-every 100
  pipeswap export ckpt --model my-gpt2 --out my-gpt2-trained   # then from_pretrained("my-gpt2-trained")
  pipeswap export ckpt --out trained            # a zoo model's checkpoint needs no --model
"""


_HELPS = {
    "out": "the folder to write the model into",
    "model": "the model the run trained (its {model}: a Hugging Face directory or "
    "module:function); required unless it is a zoo model. A checkpoint only records the "
    "name, and export refuses one that differs: nothing a checkpoint names is imported or "
    "loaded on its own say",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint's model in the format it came in (as train --save does)",
        description="Read the newest complete checkpoint in CHECKPOINT_DIR (any mode: data "
        "parallel, pipeline, emulated) and write its model to --out: a Hugging Face model as "
        "a directory from_pretrained loads (safetensors, config, tokenizer files copied), any "
        "other module as model.safetensors of its own state_dict keys.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="a run's --checkpoint-dir")
    add_options(parser, Outputs, only=("out",), required=("out",), helps=_HELPS)
    add_options(parser, TrainConfig, only=("model",), helps=_HELPS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    done, name = export_checkpoint(args.checkpoint_dir, args.out, args.model)
    print(f"pipeswap export: {name} after {done} steps -> {args.out}")
    return 0
