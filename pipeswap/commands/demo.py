"""`pipeswap demo`: the main job on CPU, as the sequence of CLI commands a user would type."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from pipeswap.cli import main
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_writable, load_json

# A step's command line, or a function that makes it once the steps before it have run.
Argv = list[str] | Callable[[], list[str]]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the main job end to end on CPU (profile, plan, simulate, train)",
        description="Runs, one after another, the commands that show what pipeswap does: "
        "measure a model on CPU, estimate a large one for a V100, plan contention-aware "
        "swapping on a PCIe server, re-simulate the plan, and train a 4-stage pipeline "
        "with weight prediction. Every command is printed before it runs, so you can "
        "copy it.",
    )
    parser.add_argument("--out", default="out/demo", help="folder for the files it writes")
    parser.set_defaults(func=run)


def _budget_of(plan_path: Path) -> str:
    """The per-GPU budget a plan was made for, as `--gpu-memory` takes it."""
    plan = load_json(plan_path)
    return str(plan["gpus"][0]["budget_bytes"])


def demo_commands(out: Path) -> list[tuple[str, Argv]]:
    """The demo's steps: a title and the argv of one `pipeswap` command each."""
    return [
        ("Where am I running?", ["env"]),
        (
            "Measure a small GPT layer by layer on this machine",
            [
                "profile",
                "--model",
                "gpt2-tiny",
                "--batch",
                "8",
                "--seq-len",
                "64",
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
                "--sync-every",
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
                "--model",
                "gpt2-tiny",
                "--batch",
                "8",
                "--seq-len",
                "64",
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
                "train",
                "--model",
                "gpt2-tiny",
                "--batch",
                "8",
                "--seq-len",
                "64",
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
                "--nproc",
                "4",
                "--report",
                str(out / "pipeline.json"),
            ],
        ),
        (
            "The same run emulated in one process: the same SHA-256, plus prediction error",
            [
                "train",
                "--model",
                "gpt2-tiny",
                "--batch",
                "8",
                "--seq-len",
                "64",
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
                "--emulate",
                "--report",
                str(out / "pipeline-emulated.json"),
            ],
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
        if callable(step):
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

    out = Path(args.out)
    steps = demo_commands(out)
    _prepare_folder(out, steps)
    started = time.perf_counter()
    for number, (title, step) in enumerate(steps, start=1):
        argv = step() if callable(step) else step
        print(f"\n=== {number}/{len(steps)} {title}")
        print(f"$ pipeswap {shlex.join(argv)}", flush=True)
        status = main(argv)
        if status != 0:
            print(f"demo: step {number} failed with exit status {status}")
            return status
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s; files in {out}/")
    return 0
