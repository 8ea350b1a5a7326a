"""`pipeswap demo`: the main job on CPU, as the sequence of CLI commands a user would type."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeswap.commands.options import add_options
from pipeswap.commands.settings import Outputs
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_writable, load_json

__all__ = [
    "DEMO_OUT",
    "Argv",
    "PythonStep",
    "demo_commands",
    "hugging_face_steps",
    "register",
    "run",
]


@dataclass(frozen=True)
class PythonStep:
    """A step no pipeswap command does (making a model, loading one with transformers):
    the Python it runs, shown before it runs, and the function that returns what it prints."""

    code: str
    run: Callable[[], str]


# A step's command line, a function that makes it once the steps before it have run, or
# a step in Python.
Argv = list[str] | Callable[[], list[str]] | PythonStep


# Where the demo writes when --out is not given.
DEMO_OUT = "out/demo"
_OUT_HELP = f"folder for the files it writes (default {DEMO_OUT})"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the main job end to end on CPU (profile, plan, simulate, train)",
        description="Runs, one after another, the commands that show what pipeswap does: "
        "measure a model on CPU, estimate a large one for a V100, plan contention-aware "
        "swapping on a PCIe server, re-simulate the plan, train a 4-stage pipeline with "
        "weight prediction, then train a small Hugging Face Llama with its own tokenizer "
        "on a text corpus in bf16 (swapping, and as a pipeline), save it, and reload it "
        "with transformers to generate text. Every command is printed before it runs, so "
        "you can copy it.",
    )
    add_options(parser, Outputs, only=("out",), helps={"out": _OUT_HELP})
    parser.set_defaults(func=run)


def _budget_of(plan_path: Path) -> str:
    """The per-GPU budget a plan was made for, as `--gpu-memory` takes it."""
    plan = load_json(plan_path)
    return str(plan["gpus"][0]["budget_bytes"])


def demo_commands(out: Path) -> list[tuple[str, Argv]]:
    """The demo's steps: a title and the argv of one `pipeswap` command each."""
    # The small GPT the demo measures and trains, at the batch every step of it takes.
    gpt2_tiny = ["--model", "gpt2-tiny", "--batch", "8", "--seq-len", "64"]
    # The pipeline run, trained over 4 processes and then emulated in one.
    pipeline_run = [
        "train",
        *gpt2_tiny,
        "--pipeline",
        "4",
        "--schedule",
        "async-1f1b",
        "--optimizer",
        "adam",
        "--weights",
        "predict-adam",
        "--steps",
        "20",
    ]
    return [
        ("Where am I running?", ["env"]),
        (
            "Measure a small GPT layer by layer on this machine",
            [
                "profile",
                *gpt2_tiny,
                "--device",
                "cpu",
                "--repeats",
                "3",
                "--out",
                str(out / "gpt2-tiny.json"),
            ],
        ),
        (
            "Estimate GPT-2 large on a V100 (meta device, no GPU needed)",
            [
                "profile",
                "--model",
                "gpt2-large",
                "--batch",
                "8",
                "--seq-len",
                "1024",
                "--estimate",
                "--gpu",
                "v100-32gb",
                "--out",
                str(out / "gpt2-large.json"),
            ],
        ),
        ("The server we plan for", ["topology", "show", "switch-4"]),
        (
            "Plan swapping for 4 data-parallel GPUs at 1.5x their memory, every policy",
            [
                "plan",
                "--profile",
                str(out / "gpt2-large.json"),
                "--topology",
                "switch-4",
                "--footprint-ratio",
                "1.5",
                "--accumulate",
                "4",
                "--compare",
                "--time-limit",
                "10",
                "--out",
                str(out / "plan.json"),
                "--graph-out",
                str(out / "plan-graph.json"),
                "--timeline",
                str(out / "plan.png"),
            ],
        ),
        (
            "Audit the chosen plan: re-simulate the exact graph it was scored on",
            lambda: [
                "simulate",
                "--graph",
                str(out / "plan-graph.json"),
                "--topology",
                "switch-4",
                "--gpu-memory",
                _budget_of(out / "plan.json"),
            ],
        ),
        (
            "Apply a plan to real training: 2 data-parallel ranks over gloo, swapping",
            [
                "train",
                *gpt2_tiny,
                "--steps",
                "5",
                "--nproc",
                "2",
                "--swap-policy",
                "disjoint",
                "--footprint-ratio",
                "1.5",
                "--report",
                str(out / "swap-train.json"),
            ],
        ),
        (
            "A pipeline that never flushes: 4 stages, one-forward-one-backward",
            ["schedule", "show", "--schedule", "async-1f1b", "--stages", "4", "--steps", "6"],
        ),
        (
            "Train it: 4 processes over gloo, each pass on predicted weights (SpecTrain's "
            "prediction with Adam's step: predict-adam)",
            [
                *pipeline_run,
                "--nproc",
                "4",
                "--report",
                str(out / "pipeline.json"),
            ],
        ),
        (
            "The same run emulated in one process: the same SHA-256, plus prediction error",
            [
                *pipeline_run,
                "--emulate",
                "--report",
                str(out / "pipeline-emulated.json"),
            ],
        ),
        *hugging_face_steps(out),
    ]


def hugging_face_steps(out: Path) -> list[tuple[str, Argv]]:
    """A user's model, their data, their precision, their weights back: a small Llama with
    its own tokenizer, trained in bf16 with swapping and as a pipeline, saved, and loaded
    again by transformers alone to generate text."""
    model, corpus = out / "llama", out / "corpus.jsonl"
    recipe = [
        "train",
        "--model",
        str(model),
        "--data",
        str(corpus),
        "--seq-len",
        "64",
        "--batch",
        "16",
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "adamw",
        "--lr",
        "5e-3",
        "--lr-warmup",
        "10",
        "--lr-schedule",
        "cosine",
        "--steps",
        "60",
    ]

    def make() -> str:
        from pipeswap.commands.demo_model import make_demo_model

        made_corpus, made_model = make_demo_model(out)
        return f"wrote {made_corpus} (the standard library's docstrings) and {made_model}"

    def generate() -> str:
        from pipeswap.commands.demo_model import sample

        prompt = "Return the"
        return f"{prompt!r} -> {sample(out / 'llama-trained', prompt)!r}"

    return [
        (
            "Your own model and data: a small Llama with its own BPE tokenizer, and a corpus",
            PythonStep("pipeswap.commands.demo_model.make_demo_model(out)", make),
        ),
        (
            "Train it on the corpus in bf16: 2 data-parallel ranks, swapping (hybrid plan)",
            [
                *recipe,
                "--nproc",
                "2",
                "--swap-policy",
                "hybrid",
                "--footprint-ratio",
                "1.5",
                "--report",
                str(out / "llama-swap.json"),
            ],
        ),
        (
            "The same model as a 2-stage pipeline (1F1B, 2 processes), saved as it came in",
            [
                *recipe,
                "--pipeline",
                "2",
                "--schedule",
                "1f1b",
                "--micro-batches",
                "2",
                "--nproc",
                "2",
                "--save",
                str(out / "llama-trained"),
                "--report",
                str(out / "llama-pipeline.json"),
            ],
        ),
        (
            "Load it back with transformers alone (from_pretrained) and generate",
            PythonStep(
                f"AutoModelForCausalLM.from_pretrained({str(out / 'llama-trained')!r})"
                ".generate(...)",
                generate,
            ),
        ),
    ]


# The options by which the demo's steps name the files they write.
_OUTPUT_FLAGS = ("--out", "--graph-out", "--trace", "--timeline", "--report")


def _prepare_folder(out: Path, steps: list[tuple[str, Argv]]) -> None:
    """Refuse an --out that is not a folder and cannot be made one, or a file inside it that
    a step could not write, before the first step runs; then create the folder."""
    if out.exists() and not out.is_dir():
        raise PipeswapError(
            f"--out {out} is a file, not a folder; give a folder (it is created if missing)"
        )
    existing = next(p for p in (out, *out.parents) if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        raise PipeswapError(
            f"cannot create folder {out}: {existing} is a file, not a folder; choose another --out"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PipeswapError(
            f"cannot write in {out}: permission denied in {existing}; choose another --out"
        )
    for _title, step in steps:
        if callable(step) or isinstance(step, PythonStep):
            continue
        for flag, value in zip(step, step[1:]):
            if flag in _OUTPUT_FLAGS:
                check_writable(value)  # e.g. a folder where the demo writes plan.json
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PipeswapError(
            f"cannot create folder {out}: {exc.strerror or exc}; choose another --out"
        ) from None


def run(args: argparse.Namespace) -> int:

    out = Path(args.out or DEMO_OUT)
    steps = demo_commands(out)
    _prepare_folder(out, steps)
    started = time.perf_counter()
    for number, (title, step) in enumerate(steps, start=1):
        print(f"\n=== {number}/{len(steps)} {title}")
        if isinstance(step, PythonStep):
            print(f">>> {step.code}", flush=True)
            print(step.run())
            continue
        argv = step() if callable(step) else step
        print(f"$ pipeswap {shlex.join(argv)}", flush=True)
        status = args.main(argv)  # the `pipeswap` command (pipeswap.cli)
        if status != 0:
            print(f"demo: step {number} failed with exit status {status}")
            return status
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s; files in {out}/")
    return 0
