"""Swap policies on estimated V100-32GB profiles: iteration time, speedup, gap to the bound.

Run from the repository root:

    .venv/bin/python benchmarks/swap_policies.py                # full grid -> docs/results
    .venv/bin/python benchmarks/swap_policies.py --quick --no-write   # seconds, for tests

Quick grid: resnet50 (batch 64) at ratios 1.33 and 2.0 on switch-4, MIP limit 2 s.
Full grid: gpt2-large, bert-large, resnet152, vit-l16, vgg16 (batch sizes where
activations dominate) x footprint ratios 1.33, 1.5, 2.0 x topologies switch-4,
single-root-8, dual-root-8 x --sync-every 1 and 4, every policy; then the single-GPU
comparison of the MIP with the best heuristic. The MIP runs with a 10 s time limit per
case (not the CLI's 60 s) to keep the grid in minutes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.jsonio import write_atomic
from pipeswap.profile import Profile
from pipeswap.profiling import estimate
from pipeswap.swap.planner import PlanResult, make_case, plan_case

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "swap_policies.md"
HEURISTICS = ("oblivious", "disjoint", "bidirectional")
POLICIES = HEURISTICS + ("mip",)
PUBLISHED = {1.33: 38.3, 2.0: 31.8}  # HPCA 2023, average speedup over contention-oblivious

FULL_MODELS: dict[str, dict[str, int]] = {
    "gpt2-large": {"batch": 8, "seq_len": 1024},
    "bert-large": {"batch": 32, "seq_len": 512},
    "resnet152": {"batch": 128, "image_size": 224},
    "vit-l16": {"batch": 64, "image_size": 224},
    "vgg16": {"batch": 128, "image_size": 224},
}
QUICK_MODELS: dict[str, dict[str, int]] = {"resnet50": {"batch": 64, "image_size": 224}}


@dataclass(frozen=True)
class Grid:
    models: dict[str, dict[str, int]]
    ratios: tuple[float, ...]
    topologies: tuple[str, ...]
    sync_every: tuple[int, ...]
    time_limit_s: float


FULL = Grid(FULL_MODELS, (1.33, 1.5, 2.0), ("switch-4", "single-root-8", "dual-root-8"),
            (1, 4), 10.0)
QUICK = Grid(QUICK_MODELS, (1.33, 2.0), ("switch-4",), (1, 4), 2.0)


@dataclass(frozen=True)
class Row:
    model: str
    topology: str
    ratio: float
    sync_every: int
    results: dict[str, PlanResult]

    @property
    def best(self) -> PlanResult:
        return min(self.results.values(), key=lambda r: r.iteration_s)

    def speedup(self, policy: str) -> float:
        return self.results["oblivious"].iteration_s / self.results[policy].iteration_s


Single = tuple[str, float, PlanResult, PlanResult]


def run_grid(grid: Grid, log: bool = True) -> tuple[list[Row], list[Single], list[str]]:
    """Every case of ``grid``; cases whose budget is below the unswappable minimum are
    listed in the third element instead (the planner refuses them)."""
    rows: list[Row] = []
    single: list[Single] = []
    refused: list[str] = []
    for model, shape in grid.models.items():
        profile = estimate(model, gpu="v100-32gb", **shape)
        for ratio in grid.ratios:
            try:
                make_case(profile, preset("switch-4"), footprint_ratio=ratio)
            except PipeswapError as exc:
                refused.append(f"{model} at ratio {ratio}: {exc}")
                continue
            for topology in grid.topologies:
                for sync_every in grid.sync_every:
                    case = make_case(profile, preset(topology), footprint_ratio=ratio,
                                     sync_every=sync_every)
                    results = {p: plan_case(case, profile, p, time_limit_s=grid.time_limit_s)
                               for p in POLICIES}
                    rows.append(Row(model, topology, ratio, sync_every, results))
                    if log:
                        print(_case_line(rows[-1]), file=sys.stderr, flush=True)
            single.append((model, ratio, *_single_gpu(profile, ratio, grid.time_limit_s)))
    return rows, single, refused


def _single_gpu(profile: Profile, ratio: float,
                time_limit_s: float) -> tuple[PlanResult, PlanResult]:
    case = make_case(profile, preset("switch-4"), gpus=1, footprint_ratio=ratio)
    heuristics = [plan_case(case, profile, p) for p in HEURISTICS]
    best = min(heuristics, key=lambda r: r.iteration_s)
    return best, plan_case(case, profile, "mip", time_limit_s=time_limit_s)


def _case_line(row: Row) -> str:
    times = " ".join(f"{p}={r.iteration_s:.3f}" for p, r in row.results.items())
    return (f"{row.model} {row.topology} x{row.ratio} K={row.sync_every} "
            f"bound={row.best.lower_bound_s:.3f} turn={row.best.turn_bound_s:.3f} {times}")


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def report(rows: list[Row], single: list[Single], refused: list[str], grid: Grid,
           command: str, elapsed_s: float) -> str:
    lines = [
        "# Swap policies: contention-aware swapping vs. contention-oblivious",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.node() or 'unknown'}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}  ",
        f"Date: {datetime.date.today().isoformat()}; wall time {elapsed_s:.0f} s "
        f"({elapsed_s / 60:.1f} min, from the first profile estimate to the last plan)  ",
        "Profiles: `pipeswap.profiling.estimate(model, gpu=\"v100-32gb\")` (FLOP-count "
        "estimates, not measurements); budgets: the no-swap peak divided by the footprint "
        f"ratio; PCIe gen3 presets (12 GB/s per direction); MIP time limit {grid.time_limit_s:g} s "
        "per case. All times are simulated iteration times (`pipeswap simulate` of the exported "
        "graph reproduces each).",
        "",
        "## Every case",
        "",
        "Iteration time in seconds; in brackets the speedup over `oblivious` (ratio of "
        "iteration times, same run) and the gap of the plan to the best bound known (the "
        "larger of the design.md link bound and the turn bound, see below).",
        "",
        "| model | topology | ratio | K | link bound s | turn bound s | "
        + " | ".join(POLICIES) + " | best |",
        "|---|---|---|---|---|---|" + "---|" * len(POLICIES) + "---|",
    ]
    for row in rows:
        cells = []
        for policy in POLICIES:
            r = row.results[policy]
            cells.append(
                f"{r.iteration_s:.3f} ({row.speedup(policy):.3f}x, {_pct(r.gap_to_best_bound)})"
            )
        lines.append(
            f"| {row.model} | {row.topology} | {row.ratio} | {row.sync_every} | "
            f"{row.best.lower_bound_s:.3f} | {row.best.turn_bound_s:.3f} | "
            + " | ".join(cells) + f" | {row.best.policy} |"
        )
    lines += ["", "## Means per footprint ratio", "",
              "Mean speedup of each policy over `oblivious` (iteration-time ratio - 1), and the "
              "mean gap of the best plan to the design.md link bound and to the best bound known; "
              "published: the HPCA 2023 averages over a contention-oblivious baseline (real "
              "servers, their models).", "",
              "| ratio | cases | " + " | ".join(p for p in POLICIES if p != "oblivious")
              + " | best | best gap to link bound | best gap to best bound | published |",
              "|---|---|" + "---|" * (len(POLICIES) - 1) + "---|---|---|---|"]
    for ratio in grid.ratios:
        subset = [r for r in rows if r.ratio == ratio]
        if not subset:
            continue
        means = [statistics.mean(r.speedup(p) for r in subset) - 1 for p in POLICIES
                 if p != "oblivious"]
        best = statistics.mean(r.speedup(r.best.policy) for r in subset) - 1
        gap = statistics.mean(r.best.gap_to_bound for r in subset)
        gap_best = statistics.mean(r.best.gap_to_best_bound for r in subset)
        published = f"{PUBLISHED[ratio]:.1f}%" if ratio in PUBLISHED else "-"
        lines.append(f"| {ratio} | {len(subset)} | " + " | ".join(_pct(m) for m in means)
                     + f" | {_pct(best)} | {_pct(gap)} | {_pct(gap_best)} | {published} |")
    for sync_every in grid.sync_every:
        subset = [r for r in rows if r.sync_every == sync_every]
        best = statistics.mean(r.speedup(r.best.policy) for r in subset) - 1
        lines.append(f"\nWith --sync-every {sync_every}: best policy {_pct(best)} over oblivious "
                     f"on average ({len(subset)} cases).")
    lines += _checks(rows)
    lines += ["", BOUNDS_NOTE.rstrip()]
    if refused:
        lines += ["", "## Cases the planner refuses", ""]
        lines += [f"- {reason}" for reason in refused]
    lines += ["", "## One GPU: MIP vs the best heuristic", "",
              "| model | ratio | best heuristic | its s | mip s | mip estimate s | mip gap | kept |",
              "|---|---|---|---|---|---|---|---|"]
    for model, ratio, heuristic, mip in single:
        gap = "-" if mip.mip_gap is None else f"{100 * mip.mip_gap:.2f}%"
        lines.append(
            f"| {model} | {ratio} | {heuristic.policy} | {heuristic.iteration_s:.3f} | "
            f"{mip.iteration_s:.3f} | {mip.notes.get('mip_estimate_s', float('nan')):.3f} | "
            f"{gap} | {mip.notes.get('kept', '-')} |"
        )
    return "\n".join(lines) + "\n"


BOUNDS_NOTE = """\
## The two bounds, and why the gap to design.md's bound cannot reach 5%

**Link bound** (design.md, `lower_bound_s`): max(compute of the busiest GPU, for every
directed link the bytes that must cross it / its bandwidth), where each GPU moves at least
D = peak - budget bytes each way per micro-batch. It lets the bytes move at any moment of
the iteration.

**Turn bound** (`turn_bound_s`, derivation in `pipeswap/swap/bounds.py`): the bytes that
are off the GPU at a layer must have *finished* their swap-out before that layer's forward
starts (and could only leave after the forward that made them), and must *start* coming
back after that layer's backward starts and finish before their own backward. On a GPU
whose own path carries B bytes/s per direction, a micro-batch therefore takes at least
max(F, D/B) + max(Bk, D/B) (F, Bk: forward and backward compute), and the exact
longest-path recursion over every layer's need, which is tighter; micro-batches are
serial, so K of them plus the last gradient bucket's all-reduce and the optimizer step
bound the iteration. For a link shared by G GPUs, the K*G*need bytes must cross it after
the first forward ends and before the last micro-batch reaches that layer, whatever the
offsets: F_0 + K*G*need/C + (the compute left after that layer) bounds it too, and the
mirror for prefetches. Both bounds hold for every plan the iteration graph can express
(any tensors, points, offsets, sync-every, one or two copy engines): the tests check it
on random small workloads with random plans and random offsets (`tests/swap/test_bounds.py`),
and the checks below count the benchmark's plans that beat either (none may).

Why the target "mean gap to the lower bound at most 5%" is not reachable against the link
bound with honest physics: on PCIe gen3 (12 GB/s per direction, the measured figure of
reference/hardware.md), resnet152 at ratio 1.5 must move D = 7.8 GB each way per
micro-batch; one GPU alone needs D/B = 0.65 s to move it but its forward lasts 0.46 s, so
even a GPU with the link to itself cannot run a micro-batch in the 1.30 s compute time the
link bound allows (at least 0.65 + 0.84 = 1.49 s). With two GPUs behind one switch and
K = 1, the 2 x 7.8 GB cannot start leaving before the first forward layer ends and must be
gone before the last forward layers, so the iteration takes at least 2.16 s against the
link bound's 1.31 s. No plan can close those gaps; the turn bound states them.

What remains above the best bound is mostly the offset of bidirectional overlapping: the
late GPU of each channel starts later by about one GPU's swap-out time (or one forward
pass) and pays it once per gradient sync, which neither bound charges (a shared-link
bound that stays valid under offsets cannot); with K = 1 the two bounds leave little
room, with K = 4 the offset is amortized but the per-GPU turn bound does not see the
channel being shared in the steady state.
"""


def _checks(rows: list[Row]) -> list[str]:
    slower = [r for r in rows
              if any(r.results["mip"].iteration_s > r.results[h].iteration_s + 1e-9
                     for h in HEURISTICS)]
    plan_s = max(r.results[h].solve_s for r in rows for h in HEURISTICS)
    over_budget = [r for r in rows for res in r.results.values()
                   for g in res.gpus if g.peak_bytes > g.budget_bytes]
    gap = statistics.mean(r.best.gap_to_bound for r in rows)
    gap_best = statistics.mean(r.best.gap_to_best_bound for r in rows)
    by_k = {
        k: statistics.mean(r.best.gap_to_best_bound for r in rows if r.sync_every == k)
        for k in sorted({r.sync_every for r in rows})
    }
    beaten = [r for r in rows for res in r.results.values()
              if res.iteration_s < res.bound_s * (1 - 1e-9)]
    mip_kept = sum(1 for r in rows if str(r.results["mip"].notes.get("kept", "")).startswith("mip"))
    return [
        "",
        "## Checks",
        "",
        f"- mip slower than some heuristic: {len(slower)} of {len(rows)} cases.",
        f"- mip's own plan kept (simulated faster than its warm start): {mip_kept} of {len(rows)}.",
        f"- mean gap of the best policy to the design.md lower bound: {100 * gap:.2f}% "
        f"(target: at most 5%).",
        f"- mean gap of the best policy to the best bound known (max of link and turn "
        f"bounds): {100 * gap_best:.2f}% ("
        + ", ".join(f"K={k}: {100 * v:.2f}%" for k, v in by_k.items()) + ").",
        f"- plans faster than a bound (would mean a bound is wrong): {len(beaten)}.",
        f"- slowest heuristic plan (including its simulation): {plan_s:.2f} s (target: under 2 s).",
        f"- GPUs over budget in simulation: {len(over_budget)}.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced grid (seconds)")
    parser.add_argument("--no-write", action="store_true", help="print instead of writing")
    parser.add_argument("--out", default=str(RESULTS), help="results file (markdown)")
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else FULL
    started = time.perf_counter()
    rows, single, refused = run_grid(grid)
    command = "python benchmarks/swap_policies.py" + (" --quick" if args.quick else "")
    text = report(rows, single, refused, grid, command, time.perf_counter() - started)
    if args.no_write:
        print(text)
    else:
        write_atomic(args.out, text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
