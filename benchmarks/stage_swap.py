"""Pipelines whose stages swap, run for real: each stage's peak of saved tensors against its budget.

Run from the repository root:

    .venv/bin/python benchmarks/stage_swap.py                    # writes docs/results/stage_swap.md
    .venv/bin/python benchmarks/stage_swap.py --quick --out /tmp/stage_swap.md   # seconds, for tests

Each case is a pipeline of gpt2-tiny trained in one gloo process per stage on this
machine's CPU (``--quick``: emulated in one process), once per policy: ``keep`` (the
stages' swappers measure but a budget of 1 TiB makes every plan empty), PyTorch's
``save-on-cpu`` baseline (every layer to host memory), and the planned policies at the
same footprint ratio. Per run: the most bytes of saved tensors any stage held (and per
stage, against what its budget leaves), beside the most the plans' memory model gives
for a stage; the run's wall time per step (the run with the median step of three: this
shared machine's speed moves between runs); and whether its weights equal the ``keep`` run's
bit for bit. A policy a case cannot run is listed with the reason it was refused.
On a CPU the copies are memory copies on the cores that compute, and four processes
share this machine's two cores: step ratios move by a quarter from one run of the page
to the next, so the page speaks for memory and bits, not for speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, header

from pipeswap.config_fields import ConfigError
from pipeswap.jsonio import write_atomic
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.pipeline_parallel import run_pipeline
from pipeswap.units import format_bytes

RESULTS = RESULTS_DIR / "stage_swap.md"
KEEP = "keep"
RATIO = 1.3
REPEATS = 3
TiB = 2**40


@dataclass(frozen=True)
class Case:
    stages: int
    schedule: str
    micro_batches: int
    weights: str = "stale"


FULL = (Case(2, "gpipe", 8), Case(4, "1f1b", 8), Case(4, "async-1f1b", 1, "spectrain"))
QUICK = (Case(2, "gpipe", 4),)
POLICIES = (KEEP, "save-on-cpu", "disjoint", "oblivious", "recompute", "hybrid")
QUICK_POLICIES = (KEEP, "disjoint")


def config_of(case: Case, policy: str, *, quick: bool) -> TrainConfig:
    swap = (
        SwapConfig(policy="hybrid", gpu_memory_bytes=TiB)
        if policy == KEEP
        else SwapConfig(policy=policy, footprint_ratio=RATIO)
    )
    config = TrainConfig(
        "gpt2-tiny",
        batch=16 if quick else 32,
        seq_len=32 if quick else 128,
        steps=2 if quick else 6,
        device="cpu",
        optim=OptimizerConfig(
            optimizer="sgd", lr=0.05, momentum=0.9 if case.weights == "spectrain" else 0.0
        ),
        pipeline=PipelineConfig(
            stages=case.stages,
            schedule=case.schedule,
            weights=case.weights,
            micro_batches=case.micro_batches,
            emulate=quick,
        ),
        swap=swap,
        progress=False,
    )
    return resolve_pipeline(config.resolved())


def run_case(case: Case, policy: str, *, quick: bool) -> dict[str, Any]:
    """One policy's row: its figures, the median step of its repetitions."""
    runs = []
    for _ in range(1 if quick else REPEATS):
        try:
            runs.append(run_once(case, policy, quick=quick))
        except ConfigError as refused:
            return {"refused": str(refused)}
    # The run with the median step; plans come from a profile timed anew each run, so a
    # policy may choose other layers from one run to the next (marked in the table).
    row = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]
    row["varied"] = len({tuple(r["peaks"]) for r in runs}) > 1
    row["runs"] = len(runs)
    row["within"] = all(p <= b for r in runs for p, b in zip(r["peaks"], r["budgets"]))
    assert all(r["sha"] == row["sha"] for r in runs)
    return row


def run_once(case: Case, policy: str, *, quick: bool) -> dict[str, Any]:
    config = config_of(case, policy, quick=quick)
    started = time.perf_counter()
    result = run_pipeline(config)
    assert result is not None
    report = result.to_report()
    swap = report["stage_swap"]
    stages = swap["stages"]
    measured = swap["measured"]
    budget = swap["budget_bytes"]
    return {
        "modelled": max(
            s["planned_peak_bytes"] - (budget - s["saved_budget_bytes"]) for s in stages
        ),
        "peak": max(m["peak_saved_bytes"] for m in measured),
        "peaks": [m["peak_saved_bytes"] for m in measured],
        "budgets": [stages[r % len(stages)]["saved_budget_bytes"] for r in range(len(measured))],
        "budget": swap["budget_bytes"],
        "moved": sum(m["swapped_bytes"] for m in measured),
        "recomputed": sum(len(m["recomputed_layers"]) for m in measured),
        "late": sum(m["late_fetches"] for m in measured),
        "step_s": report["measured_step_s"],
        "sha": report["params_sha256"],
        "seconds": time.perf_counter() - started,
    }


def case_title(case: Case) -> str:
    return (
        f"{case.stages} stages, {case.schedule}/{case.weights}, {case.micro_batches} micro-batches"
    )


def table(case: Case, rows: dict[str, dict[str, Any]]) -> list[str]:
    keep = rows[KEEP]
    baseline = rows.get("save-on-cpu")
    lines = [
        f"### {case_title(case)}",
        "",
        "| policy | saved peak (most of any stage) | vs keep | modelled | every stage within "
        "its budget | swapped | layers recomputed | step | vs keep | vs save-on-cpu "
        "| same bits as keep |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for policy, row in rows.items():
        if "refused" in row:
            lines.append(f"| {policy} | refused: {row['refused']} |" + " |" * 9)
            continue
        within = row["within"]
        budgeted = "—" if policy in (KEEP, "save-on-cpu") else ("yes" if within else "**no**")
        lines.append(
            f"| {policy}{' †' if row.get('varied') else ''} | {format_bytes(row['peak'])} | {row['peak'] / keep['peak']:.2f}x "
            f"| {format_bytes(row['modelled'])} | {budgeted} | {format_bytes(row['moved'])} | {row['recomputed']} "
            f"| {row['step_s'] * 1e3:.1f} ms | {row['step_s'] / keep['step_s']:.2f}x "
            + (f"| {row['step_s'] / baseline['step_s']:.2f}x " if baseline else "| — ")
            + f"| {'yes' if row['sha'] == keep['sha'] else '**no**'} |"
        )
    if any(r.get("varied") for r in rows.values()):
        lines += [
            "",
            "† the plan differed between the runs (each times its own profile): the row is the "
            "run with the median step.",
        ]
    planned = [r for p, r in rows.items() if p not in (KEEP, "save-on-cpu") and "budgets" in r]
    if planned:
        budgets = ", ".join(format_bytes(b) for b in planned[0]["budgets"])
        lines += [
            "",
            f"Budget {format_bytes(planned[0]['budget'])} per GPU (the largest stage's "
            f"no-swap peak / {RATIO}); what it leaves for saved tensors, per rank: {budgets}.",
        ]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one emulated case, two policies")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    cases, policies = (QUICK, QUICK_POLICIES) if args.quick else (FULL, POLICIES)
    body = [
        header("Pipelines whose stages swap, run for real", "stage_swap.py", argv),
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        "",
    ]
    every: list[dict[str, Any]] = []
    for case in cases:
        rows = {}
        for policy in policies:
            rows[policy] = run_case(case, policy, quick=args.quick)
            print(f"{case_title(case)} {policy}: {rows[policy]}", file=sys.stderr)
        body += table(case, rows)
        keep_sha = rows[KEEP]["sha"]
        every += [
            {**row, "planned": policy not in (KEEP, "save-on-cpu"), "same": row["sha"] == keep_sha}
            for policy, row in rows.items()
            if "refused" not in row
        ]
    planned = [r for r in every if r["planned"]]
    within = all(r["within"] for r in planned)
    body += [
        "## Summary",
        "",
        f"- every stage of every planned run within its budget: {'yes' if within else 'no'} "
        f"({sum(r['runs'] for r in planned)} runs)",
        f"- weights bit-identical to keeping everything: "
        f"{sum(r['same'] for r in every)} of {len(every)} runs",
        f"- late fetches (a backward reading a tensor before its prefetch): "
        f"{sum(r['late'] for r in every)}",
        "",
    ]
    text = "\n".join(body)
    print(text)
    write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
