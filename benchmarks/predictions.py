"""How far the simulator's step time is from the measured one, on this machine.

Run from the repository root:

    .venv/bin/python benchmarks/predictions.py                   # writes the table
    .venv/bin/python benchmarks/predictions.py --quick --out /tmp/p.md

First ``pipeswap topology calibrate --nproc 2`` measures this machine (copies,
collectives, compute contention) into a topology file. Then a grid of data-parallel runs
(gpt2-tiny, resnet-micro and a Hugging Face Llama directory; 1 and 2 ranks; swap
policies none, disjoint, bidirectional, hybrid) trains with ``pipeswap.train``, twice:
planned for the preset switch-4 (what a run on this CPU machine used by default) and for
the calibrated file. Each run reports the simulator's step time for its plan and the
measured median step (slowest rank); the table gives both predictions' relative errors,
and their median and worst.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, header

from pipeswap.hardware.calibration import calibrated_path

RESULTS = RESULTS_DIR / "predictions.md"
POLICIES = ("none", "disjoint", "bidirectional", "hybrid")
QUICK_POLICIES = ("none", "hybrid")
COSTS = """Costs the model was given to get here (each where the simulator could not see it):

- **The machine, measured** (`pipeswap topology calibrate`): copy rates with every rank
  copying, all-reduce and send/receive as latency + bytes / rate fitted to the backend's own
  timings, and how much slower a rank computes while the others compute (ranks share the
  cores: the profile is measured by one process alone with every thread).
- **The optimizer step, timed**: the profile times one `optimizer.step()` of the run's own
  optimizer over stand-ins of the trainable parameters (`Profile.optimizer_step_s`); data
  parallelism ends each step with it, each pipeline stage's UPDATE takes its parameters'
  share. Before, a CPU profile left it out (0): on a GPU it is estimated from HBM bandwidth.
- **Micro-batches at their own size**: a pipeline's prediction profiles the model at the
  micro-batch's size, as each action computes, instead of a share of the whole batch
  (small batches cost more than their share: per-operator overhead).
- **Copies on a CPU rank are done by the thread that computes**: in the simulator a
  swap-out on a rank of spec `cpu` holds the compute stream for its duration (a CPU stream is
  a no-op), where a GPU's copy engine overlaps it.
- **Compute beside transfers**: calibrate also times one thread's matrix products
  interleaved with send/receive exchanges between two ranks, less the exchanges alone, over
  the products alone (the `transfer_slowdown` in the calibration below: gloo's transport
  threads share the two cores), and one thread's products with every rank at once over
  rank 0's alone (the `stage_slowdown`: more ranks than cores share them); a pipeline's
  prediction slows its one-thread profile by both.

Not modelled: Python's per-layer and per-action overhead beyond what the profile's own
block-by-block step pays, and the machine's speed changing between the profile and the
run (the spread column)."""


def _hf_directory(root: Path) -> str:
    """A tiny Llama (vocabulary 512) saved as a Hugging Face directory, weights seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    directory = root / "llama-dir"
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def calibrate(out: Path, quick: bool) -> None:
    command = [sys.executable, "-m", "pipeswap", "topology", "calibrate", "--nproc", "2"]
    command += ["--out", str(out)] + (["--quick"] if quick else [])
    subprocess.run(command, check=True)


def run(model: str, nproc: int, policy: str, topology: str, steps: int) -> dict[str, float]:
    from pipeswap import SwapConfig, TrainConfig, train

    config = TrainConfig(
        model,
        nproc=nproc,
        steps=steps,
        device="cpu",
        progress=False,
        # A budget the policies must keep by swapping (none keeps everything).
        topology=topology,
        swap=SwapConfig(policy=policy, footprint_ratio=None if policy == "none" else 1.5),
    )
    outcome = train(config)
    assert outcome is not None
    details = outcome.report.data_parallel
    assert details is not None
    return {"measured": details.measured_step_s, "predicted": details.predicted_step_s}


def run_pipeline(model: str, schedule: str, steps: int) -> dict[str, float]:
    from pipeswap import PipelineConfig, TrainConfig, train

    weights = "spectrain" if schedule == "async-1f1b" else "stale"
    config = TrainConfig(
        model,
        steps=steps * (4 if schedule == "async-1f1b" else 1),
        device="cpu",
        progress=False,
        pipeline=PipelineConfig(stages=2, schedule=schedule, weights=weights),
    )
    outcome = train(config)
    assert outcome is not None
    details = outcome.report.pipeline
    assert details is not None and details.predicted_step_s is not None
    assert details.measured_step_s is not None
    return {"measured": details.measured_step_s, "predicted": details.predicted_step_s}


def _error(row: dict[str, Any], key: str) -> float:
    return (row[key] - row["measured"]) / row["measured"]


def repeated(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The median measured and predicted step of repeated runs of one cell, and each run's
    own error (the machine's run-to-run spread is part of what a prediction meets)."""
    return {
        "measured": statistics.median(r["measured"] for r in runs),
        "predicted": statistics.median(r["predicted"] for r in runs),
        "errors": [(r["predicted"] - r["measured"]) / r["measured"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one model, two policies (tests)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 16)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of each cell (default 3; --quick 1)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the table")
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 3)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        machine = Path(folder) / "machine.json"
        calibrate(machine, args.quick)
        models = (
            ["gpt2-micro"]
            if args.quick
            else ["gpt2-tiny", "resnet-micro", _hf_directory(Path(folder))]
        )
        policies = QUICK_POLICIES if args.quick else POLICIES
        for model in models:
            for nproc in (1, 2):
                for policy in policies:
                    preset = repeated(
                        [run(model, nproc, policy, "switch-4", steps) for _ in range(repeats)]
                    )
                    mine = repeated(
                        [run(model, nproc, policy, str(machine), steps) for _ in range(repeats)]
                    )
                    name = "llama directory" if model.endswith("llama-dir") else model
                    row = {
                        "model": name,
                        "ranks": nproc,
                        "policy": policy,
                        # Each prediction against its own run's measurement.
                        "measured": mine["measured"],
                        "calibrated": mine["predicted"],
                        "errors": mine["errors"],
                        "preset_measured": preset["measured"],
                        "preset": preset["predicted"],
                    }
                    rows.append(row)
                    print(row, flush=True)
        for schedule in ("gpipe", "1f1b", "async-1f1b"):
            if args.quick and schedule != "1f1b":
                continue
            model = models[0]
            # A pipeline run plans on this machine's kept calibration, else the preset.
            os.environ["PIPESWAP_HOME"] = str(Path(folder) / "empty")
            preset = repeated([run_pipeline(model, schedule, steps) for _ in range(repeats)])
            os.environ["PIPESWAP_HOME"] = str(Path(folder) / "kept")
            kept = calibrated_path("cpu", 2)
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(machine, kept)
            mine = repeated([run_pipeline(model, schedule, steps) for _ in range(repeats)])
            row = {
                "model": model,
                "ranks": 2,
                "policy": f"pipeline {schedule}",
                "measured": mine["measured"],
                "calibrated": mine["predicted"],
                "errors": mine["errors"],
                "preset_measured": preset["measured"],
                "preset": preset["predicted"],
            }
            rows.append(row)
            print(row, flush=True)
        calibration = machine.read_text()
    elapsed = time.perf_counter() - started
    lines = [
        "| model | ranks | policy | measured ms | predicted ms (calibrated) | error | "
        "each run's error | predicted ms (switch-4 preset) | error |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        preset_error = (row["preset"] - row["preset_measured"]) / row["preset_measured"]
        each = ", ".join(f"{e:+.0%}" for e in row["errors"])
        lines.append(
            f"| {row['model']} | {row['ranks']} | {row['policy']} | {row['measured'] * 1e3:.1f} | "
            f"{row['calibrated'] * 1e3:.1f} | {_error(row, 'calibrated'):+.0%} | {each} | "
            f"{row['preset'] * 1e3:.1f} | {preset_error:+.0%} |"
        )

    def spread(selected: list[dict[str, Any]]) -> str:
        errors = [abs(_error(r, "calibrated")) for r in selected]
        return f"median {statistics.median(errors):.0%}, worst {max(errors):.0%}"

    dp = [r for r in rows if "pipeline" not in r["policy"]]
    piped = [r for r in rows if "pipeline" in r["policy"]]
    presets = [abs((r["preset"] - r["preset_measured"]) / r["preset_measured"]) for r in dp]
    summary = (
        f"Absolute relative error of the calibrated prediction over the whole grid ({len(rows)} "
        f"cells): **{spread(rows)}** (done-when: median 15%, worst 30%); data parallel "
        f"({len(dp)}): {spread(dp)}; pipelines ({len(piped)}): {spread(piped)}. The switch-4 "
        f"preset, data parallel: median {statistics.median(presets):.0%}, worst "
        f"{max(presets):.0%}."
    )
    print("\n".join(lines) + "\n\n" + summary)
    body = (
        header("Predicted against measured step times", "predictions.py", argv)
        + f"{len(rows)} cells, each run {repeats} times for {steps} steps (the whole benchmark "
        f"took {elapsed:.0f} s). Measured: a run's median step after the first, of its slowest "
        "rank (pipelines: the run's wall time over its steps, fill and drain included); the "
        "table gives the median over the cell's runs, and each run's own error beside it, "
        "since this shared machine's speed moves between runs by as much as 20%. Predicted: "
        "the simulator's step for the run's plan, from the profile the run measured, on the "
        "switch-4 preset and on this machine's calibration. Pipeline rows (2 processes, 2 "
        "stages) predict from a profile measured after training, on the preset and on the "
        "calibration kept for this machine (which a pipeline run finds by itself).\n\n"
        + summary
        + "\n\n"
        + COSTS
        + "\n\n"
        + "\n".join(lines)
        + "\n\nThe calibration this run measured:\n\n```json\n"
        + calibration
        + "```\n"
    )
    from pipeswap.jsonio import write_atomic

    write_atomic(args.out, body)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
