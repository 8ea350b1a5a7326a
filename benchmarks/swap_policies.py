"""Swap policies on estimated V100-32GB profiles: iteration time, speedup, gap to the bound.

Run from the repository root:

    .venv/bin/python benchmarks/swap_policies.py                # full grid -> docs/results
    .venv/bin/python benchmarks/swap_policies.py --quick --no-write   # seconds, for tests

Quick grid: resnet50 (batch 64) at ratios 1.33 and 2.0 on switch-4, time limit 2 s.
Full grid: gpt2-large, bert-large, resnet152, vit-l16, vgg16 (batch sizes where
activations dominate) x footprint ratios 1.33, 1.5, 2.0 x topologies switch-4,
single-root-8, dual-root-8 x --accumulate 1 and 4, every policy (the swap heuristics,
the PyTorch baselines `recompute` = recompute every block and `save-on-cpu`, `hybrid`,
`mip`, `auto`); then the single-GPU comparison of the MIP and auto with the best
heuristic. The MIP and auto run with a 10 s time limit per case (not the CLI's 60 s) to
keep the grid near half an hour; auto starts from the MIP's answer on the same case and
searches for the rest of its limit. Every plan's exported graph is simulated again from
its JSON to check the numbers it reports.
"""

from __future__ import annotations

import argparse
import datetime
import math
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
from pipeswap.profiling.estimate import estimate
from pipeswap.profiling.profile import Profile
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import TaskGraph
from pipeswap.swap.plan.bounds import lower_bound, turn_bound
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.planner import PlanResult, make_case, plan_case

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "swap_policies.md"
HEURISTICS = ("oblivious", "disjoint", "bidirectional")  # the swap-only heuristics
# What PyTorch users write: torch.utils.checkpoint on every block, save_on_cpu.
BASELINES = ("recompute", "save-on-cpu")
POLICIES = HEURISTICS + BASELINES + ("hybrid", "mip", "auto")
SEARCHED = ("mip", "auto")
# Cases where the PCIe link, not compute, bounds every swap-only plan.
LINK_BOUND = (("resnet152", 1.5), ("resnet152", 2.0))
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


FULL = Grid(
    FULL_MODELS, (1.33, 1.5, 2.0), ("switch-4", "single-root-8", "dual-root-8"), (1, 4), 10.0
)
QUICK = Grid(QUICK_MODELS, (1.33, 2.0), ("switch-4",), (1, 4), 2.0)


@dataclass(frozen=True)
class Row:
    model: str
    topology: str
    ratio: float
    sync_every: int
    results: dict[str, PlanResult]
    audit: dict[str, tuple[bool, bool]]  # per policy: graph reproduces, GPUs within budget
    swap_only_bound_s: float  # the best bound of plans that only swap
    swap_only_deficit_bytes: int = 0  # per micro-batch and direction, if nothing recomputes

    @property
    def best(self) -> PlanResult:
        """The fastest plan that fits (a baseline may not)."""
        return min((r for r in self.results.values() if r.fits), key=lambda r: r.iteration_s)

    @property
    def best_swap_only(self) -> PlanResult:
        return min((self.results[p] for p in HEURISTICS), key=lambda r: r.iteration_s)

    def speedup(self, policy: str) -> float:
        return self.results["oblivious"].iteration_s / self.results[policy].iteration_s

    def best_over(self, policy: str) -> float | None:
        """Speedup of the best plan over ``policy`` (None where ``policy`` does not fit)."""
        baseline = self.results[policy]
        return baseline.iteration_s / self.best.iteration_s if baseline.fits else None


Single = tuple[str, float, PlanResult, PlanResult, PlanResult]


def audit(result: PlanResult) -> tuple[bool, bool]:
    """Simulate the plan's exported graph again from its JSON, as `pipeswap simulate`
    does: does it give the same iteration time, and does every GPU stay within budget?"""
    graph = TaskGraph.from_json(result.graph.to_json())
    again = simulate(graph, result.topology)
    # A baseline that does not fit was scored without a limit: only its time is checked.
    return (
        again.makespan_s == result.iteration_s,
        not result.fits or all(g.peak_bytes <= result.budget_bytes for g in again.gpus.values()),
    )


def swap_only_bound(case: Case) -> tuple[float, int]:
    """The best bound of plans that only swap (what the best bound was before recompute),
    and the bytes such a plan moves each way per micro-batch at least."""
    link = lower_bound(
        case.workload,
        case.topology,
        case.gpus,
        case.budget_bytes,
        sync_every=case.sync_every,
        recompute=False,
    )
    turn = turn_bound(
        case.workload,
        case.topology,
        case.gpus,
        case.budget_bytes,
        sync_every=case.sync_every,
        bucket_bytes=case.bucket_bytes,
        recompute=False,
    )
    return max(link.bound_s, turn.bound_s), link.min_swap_bytes // case.sync_every


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
                    case = make_case(
                        profile, preset(topology), footprint_ratio=ratio, sync_every=sync_every
                    )
                    results = {
                        p: plan_case(case, profile, p, time_limit_s=grid.time_limit_s)
                        for p in POLICIES
                    }
                    checks = {p: audit(r) for p, r in results.items()}
                    rows.append(
                        Row(
                            model,
                            topology,
                            ratio,
                            sync_every,
                            results,
                            checks,
                            *swap_only_bound(case),
                        )
                    )
                    if log:
                        print(_case_line(rows[-1]), file=sys.stderr, flush=True)
            single.append((model, ratio, *_single_gpu(profile, ratio, grid.time_limit_s)))
    return rows, single, refused


def _single_gpu(
    profile: Profile, ratio: float, time_limit_s: float
) -> tuple[PlanResult, PlanResult, PlanResult]:
    case = make_case(profile, preset("switch-4"), gpus=1, footprint_ratio=ratio)
    rules = HEURISTICS + ("hybrid",)
    heuristics = [plan_case(case, profile, p, time_limit_s=time_limit_s) for p in rules]
    best = min(heuristics, key=lambda r: r.iteration_s)
    mip, auto = (plan_case(case, profile, p, time_limit_s=time_limit_s) for p in SEARCHED)
    return best, mip, auto


def _case_line(row: Row) -> str:
    times = " ".join(
        f"{p}={r.iteration_s:.3f}{'' if r.fits else '(no fit)'}" for p, r in row.results.items()
    )
    return (
        f"{row.model} {row.topology} x{row.ratio} K={row.sync_every} "
        f"bound={row.best.bound_s:.3f} swap-only={row.swap_only_bound_s:.3f} {times}"
    )


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "unknown"


def _cell(row: Row, policy: str) -> str:
    r = row.results[policy]
    if not r.fits:
        peak = max(g.peak_bytes for g in r.gpus)
        return f"no fit ({peak / r.budget_bytes:.2f}x budget)"
    return f"{r.iteration_s:.3f} ({row.speedup(policy):.3f}x, {_pct(r.gap_to_best_bound)})"


def _mean(values: list[float | None]) -> tuple[float | None, int]:
    """Mean of the values that exist, and how many there were."""
    present = [v for v in values if v is not None]
    return (statistics.mean(present) if present else None), len(present)


def report(
    rows: list[Row],
    single: list[Single],
    refused: list[str],
    grid: Grid,
    command: str,
    elapsed_s: float,
    load: tuple[str, str],
) -> str:
    lines = [
        "# Swap policies: contention-aware swapping and recomputation vs. the baselines",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.node() or 'unknown'}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; load average (1/5/15 "
        f"min) {load[0]} at the start, {load[1]} at the end (a shared machine: other jobs "
        "inflate every planning time below)  ",
        f"Date: {datetime.date.today().isoformat()}; wall time {elapsed_s:.0f} s "
        f"({elapsed_s / 60:.1f} min, from the first profile estimate to the last plan)  ",
        'Profiles: `pipeswap.profiling.estimate(model, gpu="v100-32gb")` (FLOP-count '
        "estimates, not measurements); budgets: the no-swap peak divided by the footprint "
        f"ratio; PCIe gen3 presets (12 GB/s per direction); time limit of `mip` and `auto` "
        f"{grid.time_limit_s:g} s per case. All times are simulated iteration times; every "
        "plan's exported graph was simulated again from its JSON (see Checks).",
        "",
        "Policies: `oblivious`, `disjoint`, `bidirectional` only swap; `recompute` is "
        "activation checkpointing of every block (what `torch.utils.checkpoint` users "
        "write; nothing swapped); `save-on-cpu` is `torch.autograd.graph.save_on_cpu` "
        "(every saved tensor to host after its layer, fetched when its backward needs it, "
        "no coordination; its copies are modelled asynchronous, which favours it); "
        "`hybrid` recomputes the layers that free memory most cheaply where the link is "
        "the bottleneck and swaps the rest (disjoint/bidirectional); `mip` chooses swaps "
        "and recomputed layers in one program; `auto` searches from the best of all.",
        "",
        "## Every case",
        "",
        "Iteration time in seconds; in brackets the speedup over `oblivious` (ratio of "
        "iteration times, same run) and the gap of the plan to the best valid bound (the "
        "larger of the design.md link bound and the turn bound, both valid for plans that "
        "recompute, see below). `swap-only bound`: the best bound of plans that only swap. "
        "`no fit`: the baseline's peak exceeds the budget (its peak / the budget).",
        "",
        "| model | topology | ratio | K | swap-only bound s | best valid bound s | "
        + " | ".join(POLICIES)
        + " | best |",
        "|---|---|---|---|---|---|" + "---|" * len(POLICIES) + "---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.model} | {row.topology} | {row.ratio} | {row.sync_every} | "
            f"{row.swap_only_bound_s:.3f} | {row.best.bound_s:.3f} | "
            + " | ".join(_cell(row, p) for p in POLICIES)
            + f" | {row.best.policy} |"
        )
    lines += [
        "",
        "## Summary per footprint ratio",
        "",
        "Mean speedup of the best plan over each baseline (iteration-time ratio - 1; "
        "over the cases where the baseline fits, their count in brackets), the mean "
        "speedup of each policy over `oblivious`, and the mean gap of the best plan to "
        "the best valid bound; published: the HPCA 2023 averages over a "
        "contention-oblivious baseline (real servers, their models, swapping only).",
        "",
        "| ratio | cases | best over save-on-cpu | best over recompute | best over "
        "oblivious | best over best swap-only | "
        + " | ".join(f"{p} over oblivious" for p in POLICIES if p != "oblivious")
        + " | best gap to best bound | published |",
        "|---|---|---|---|---|---|" + "---|" * (len(POLICIES) - 1) + "---|---|",
    ]
    for ratio in grid.ratios:
        subset = [r for r in rows if r.ratio == ratio]
        if not subset:
            continue
        over = []
        for baseline in ("save-on-cpu", "recompute", "oblivious"):
            mean, count = _mean([r.best_over(baseline) for r in subset])
            over.append("-" if mean is None else f"{_pct(mean - 1)} ({count})")
        swap_only = (
            statistics.mean(r.best_swap_only.iteration_s / r.best.iteration_s for r in subset) - 1
        )
        means = []
        for p in POLICIES:
            if p == "oblivious":
                continue
            mean, count = _mean([r.speedup(p) if r.results[p].fits else None for r in subset])
            means.append(
                "-"
                if mean is None
                else _pct(mean - 1) + ("" if count == len(subset) else f" ({count})")
            )
        gap_best = statistics.mean(r.best.gap_to_best_bound for r in subset)
        published = f"{PUBLISHED[ratio]:.1f}%" if ratio in PUBLISHED else "-"
        lines.append(
            f"| {ratio} | {len(subset)} | "
            + " | ".join(over)
            + f" | {_pct(swap_only)} | "
            + " | ".join(means)
            + f" | {_pct(gap_best)} | {published} |"
        )
    lines.append("")
    for ratio in grid.ratios:
        subset = [r for r in rows if r.ratio == ratio]
        if not subset:
            continue
        parts = []
        for baseline in ("save-on-cpu", "recompute", "oblivious"):
            mean, count = _mean([r.best_over(baseline) for r in subset])
            parts.append(
                f"{baseline} {'-' if mean is None else _pct(mean - 1)}"
                + ("" if count == len(subset) else f" ({count} of {len(subset)} cases fit)")
            )
        lines.append(
            f"Ratio {ratio}: the best plan is faster than " + ", ".join(parts) + " on average.  "
        )
    for sync_every in grid.sync_every:
        subset = [r for r in rows if r.sync_every == sync_every]
        best = statistics.mean(r.speedup(r.best.policy) for r in subset) - 1
        lines.append(
            f"\nWith --accumulate {sync_every}: best policy {_pct(best)} over oblivious "
            f"on average ({len(subset)} cases)."
        )
    lines += _checks(rows)
    lines += _swap_vs_hybrid(rows, grid)
    lines += ["", BOUNDS_NOTE.rstrip()]
    lines += _why(rows)
    if refused:
        lines += ["", "## Cases the planner refuses", ""]
        lines += [f"- {reason}" for reason in refused]
    lines += [
        "",
        "## One GPU: MIP vs the best heuristic, and auto",
        "",
        "| model | ratio | best heuristic | its s | mip s | mip estimate s | mip gap | "
        "mip kept | auto s | best valid bound s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, ratio, heuristic, mip, auto in single:
        gap = "-" if mip.mip_gap is None else f"{100 * mip.mip_gap:.2f}%"
        lines.append(
            f"| {model} | {ratio} | {heuristic.policy} | {heuristic.iteration_s:.3f} | "
            f"{mip.iteration_s:.3f} | {mip.notes.get('mip_estimate_s', math.nan):.3f} | "
            f"{gap} | {mip.notes.get('kept', '-')} | {auto.iteration_s:.3f} | "
            f"{auto.bound_s:.3f} |"
        )
    return "\n".join(lines) + "\n"


BOUNDS_NOTE = """\
## The bounds

**Link bound** (design.md, `lower_bound_s`): max(compute of the busiest GPU, for every
directed link the bytes that must cross it / its bandwidth), where each GPU moves at least
D = peak - budget bytes each way per micro-batch. It lets the bytes move at any moment of
the iteration, which no plan can do.

**Turn bound** (`turn_bound_s`, derivation in docs/concepts.md, "Why the swap bounds are valid"), the largest of:

- *Per GPU*: the bytes off the GPU at a layer must have *finished* their swap-out before
  that layer's forward starts, and could only leave after the forward that made them; they
  may only *start* coming back once that layer's backward has ended (it holds its memory
  while it runs) and must be back before their own backward. On a path of B bytes/s per
  direction this is a longest-path recursion over every layer's need, the shortest
  possible micro-batch M (at least max(F, D/B) + max(Bk, D/B)); micro-batches are serial,
  so K M plus the last gradient bucket's all-reduce and the optimizer step.
- *Shared channel, whole sync*: the K G need bytes of G GPUs behind a link of capacity C
  must cross it after the first forward ends and before the last micro-batch reaches that
  layer.
- *Shared channel, first and last micro-batch*: whatever the offsets, the GPU of a
  channel that reaches forward i of its first micro-batch last does so only after every
  GPU's need[i] bytes crossed the link, then runs the rest of that micro-batch and K - 1
  more; mirrored for the prefetches of the last micro-batch.

**With recomputation** (new). Recomputing layer k frees its saved bytes minus the input it
keeps, from its forward on, and costs its forward once more per micro-batch. For a plan
whose GPUs recompute at most T seconds per micro-batch, no set of layers frees more bytes
among layers k..i than the fractional knapsack of the layers up to i with T seconds (nor
more than those layers' freed bytes): every byte count of both bounds, lowered by that,
gives a bound d(T) that does not grow with T, and the GPU that recomputes T computes
K (F + Bk + T) plus the tail (compute + K T for the link bound). Every plan therefore takes
at least min over T of max(d(T), compute(T)); a bisection brackets the crossing and keeps
the lower end, so the reported figure is never above that minimum. On a shared link the
re-runs count too: the GPU that recomputes least (s <= T seconds) frees at most the
knapsack's bytes at T less its slope times T - s (the knapsack is concave), and the late
GPU still re-runs s seconds in every backward after its swap-outs, so the shared-channel
and first-micro-batch swap-out terms take the least over s of bytes and re-runs together
(with the member's own shortest micro-batch at s). The best valid bound is the larger of
the two; without recomputation (`swap-only bound`) it is the previous bound, valid only
for plans that swap.

Every term holds for every plan the iteration graph can express (any tensors, points and
offsets, any recomputed layers per GPU, any sync-every, one or two copy engines): the
tests check closed forms (with and without recomputation), random plans with random
recomputed layers and offsets, and plans driven as low as the local search of `auto` can
take them from `bidirectional` and from `hybrid` (`tests/swap/plan/test_bounds.py`); the
checks above count the benchmark's plans that beat a bound (none may).
"""


def _checks(rows: list[Row]) -> list[str]:
    slower = {
        p: [
            r
            for r in rows
            if any(r.results[p].iteration_s > r.results[h].iteration_s + 1e-9 for h in HEURISTICS)
        ]
        for p in SEARCHED
    }
    auto_slower = [
        r for r in rows if r.results["auto"].iteration_s > r.results["mip"].iteration_s + 1e-9
    ]
    # hybrid or auto slower than a baseline that fits, or than any swap-only policy
    rivals = HEURISTICS + BASELINES
    beaten_by = {
        p: [
            r
            for r in rows
            if any(
                r.results[q].fits and r.results[p].iteration_s > r.results[q].iteration_s + 1e-9
                for q in rivals
            )
        ]
        for p in ("hybrid", "auto")
    }
    link_rows = [r for r in rows if (r.model, r.ratio) in LINK_BOUND]
    link_gain = [
        r.best_swap_only.iteration_s / r.results["hybrid"].iteration_s - 1 for r in link_rows
    ]
    plan_s = max(r.results[h].solve_s for r in rows for h in HEURISTICS + BASELINES)
    hybrid_s = max(r.results["hybrid"].solve_s for r in rows)
    searched_s = {p: max(r.results[p].solve_s for r in rows) for p in SEARCHED}
    over_budget = [
        r
        for r in rows
        for res in r.results.values()
        if res.fits
        for g in res.gpus
        if g.peak_bytes > g.budget_bytes
    ]
    not_reproduced = [(r, p) for r in rows for p, (same, _) in r.audit.items() if not same]
    over_again = [(r, p) for r in rows for p, (_, within) in r.audit.items() if not within]
    gap_best = statistics.mean(r.best.gap_to_best_bound for r in rows)
    by_k = {
        k: statistics.mean(r.best.gap_to_best_bound for r in rows if r.sync_every == k)
        for k in sorted({r.sync_every for r in rows})
    }
    by_model = {
        m: statistics.mean(r.best.gap_to_best_bound for r in rows if r.model == m)
        for m in dict.fromkeys(r.model for r in rows)
    }
    beaten = [
        r
        for r in rows
        for res in r.results.values()
        if res.fits and res.iteration_s < res.bound_s * (1 - 1e-9)
    ]
    swap_beaten = [
        r
        for r in rows
        for p in HEURISTICS
        if r.results[p].iteration_s < r.swap_only_bound_s * (1 - 1e-9)
    ]
    no_fit = {p: sum(1 for r in rows if not r.results[p].fits) for p in BASELINES}
    recomputing = sum(1 for r in rows if any(g.recompute for g in r.best.plan.gpus))
    mip_kept = sum(1 for r in rows if str(r.results["mip"].notes.get("kept", "")).startswith("mip"))
    auto_better = sum(
        1 for r in rows if r.results["auto"].iteration_s < r.results["mip"].iteration_s - 1e-9
    )
    worst_model = max(by_model, key=lambda m: by_model[m])
    lines = [
        "",
        "## Checks",
        "",
        f"- hybrid slower than recompute, save-on-cpu (where they fit) or any swap-only "
        f"policy: {len(beaten_by['hybrid'])} of {len(rows)} cases; auto: "
        f"{len(beaten_by['auto'])} (target 0).",
        f"- baselines that do not fit the budget: recompute {no_fit['recompute']} of "
        f"{len(rows)} cases, save-on-cpu {no_fit['save-on-cpu']}.",
        f"- best plan recomputes some layers: {recomputing} of {len(rows)} cases.",
    ]
    if link_rows:
        lines.append(
            f"- link-bound cases ({', '.join(f'{m} at ratio {q}' for m, q in LINK_BOUND)}, "
            f"every topology, K = 1 and 4; {len(link_rows)} cases): hybrid is "
            f"{_pct(statistics.mean(link_gain))} faster than the best swap-only plan on "
            f"average, {_pct(min(link_gain))} at least (target >= +10%)."
        )
    lines += [
        f"- mip slower than some swap-only heuristic: {len(slower['mip'])} of {len(rows)} "
        f"cases; auto: {len(slower['auto'])}; auto slower than mip: {len(auto_slower)}.",
        f"- mip's own plan kept (simulated faster than its warm start): {mip_kept} of "
        f"{len(rows)}; auto's local search faster than mip: {auto_better} of {len(rows)}.",
        f"- mean gap of the best plan to the best valid bound: {100 * gap_best:.2f}% "
        "(target <= 2%; K: "
        + ", ".join(f"K={k}: {100 * v:.2f}%" for k, v in by_k.items())
        + "); per model "
        "(target <= 4%): "
        + ", ".join(f"{m}: {100 * v:.2f}%" for m, v in by_model.items())
        + f"; largest: {worst_model}.",
        f"- plans faster than a bound (would mean a bound is wrong): {len(beaten)}; swap-only "
        f"plans faster than the swap-only bound: {len(swap_beaten)}.",
        f"- slowest swap-only heuristic or baseline plan (including its simulation): "
        f"{plan_s:.2f} s; slowest hybrid {hybrid_s:.1f} s, mip {searched_s['mip']:.1f} s, "
        f"auto {searched_s['auto']:.1f} s (auto searches until its time limit or a local "
        "optimum).",
        f"- GPUs over budget in simulation (plans that fit): {len(over_budget)}.",
        f"- every plan's graph simulated again from its JSON: {len(not_reproduced)} of "
        f"{len(rows) * len(POLICIES)} give another iteration time, {len(over_again)} put a "
        "GPU over its budget.",
    ]
    return lines


def _swap_vs_hybrid(rows: list[Row], grid: Grid) -> list[str]:
    """What recomputation buys, measured in this run: the best swap-only plan against the
    best plan, each against its own bound."""
    lines = [
        "",
        "## Swap only vs swap or recompute (this run)",
        "",
        "Best swap-only plan (oblivious, disjoint, bidirectional) against the best plan "
        "(every policy), each with its gap to its own best bound (swap-only bound; best "
        "valid bound).",
        "",
        "| model | ratio | cases | best swap-only s (mean) | gap to swap-only bound | "
        "best s (mean) | gap to best valid bound | best over best swap-only |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        for ratio in grid.ratios:
            subset = [r for r in rows if r.model == model and r.ratio == ratio]
            if not subset:
                continue
            swap_s = statistics.mean(r.best_swap_only.iteration_s for r in subset)
            swap_gap = statistics.mean(
                r.best_swap_only.iteration_s / r.swap_only_bound_s - 1 for r in subset
            )
            best_s = statistics.mean(r.best.iteration_s for r in subset)
            best_gap = statistics.mean(r.best.gap_to_best_bound for r in subset)
            gain = statistics.mean(
                r.best_swap_only.iteration_s / r.best.iteration_s - 1 for r in subset
            )
            lines.append(
                f"| {model} | {ratio} | {len(subset)} | {swap_s:.3f} | "
                f"{_pct(swap_gap)} | {best_s:.3f} | {_pct(best_gap)} | {_pct(gain)} |"
            )
    return lines


def _why(rows: list[Row]) -> list[str]:
    """The link-bound case in numbers from this run, and what remains above the bound."""
    lines: list[str] = []
    sample = next(
        (
            r
            for r in rows
            if (r.model, r.ratio) == LINK_BOUND[0]
            and r.sync_every == 1
            and r.topology == "switch-4"
        ),
        None,
    )
    if sample is not None:
        best = sample.best
        swap = sample.best_swap_only
        compute = best.compute_s
        deficit = sample.swap_only_deficit_bytes
        gpu = best.plan.gpus[0]
        lines += [
            "",
            f"Why recomputation pays where the link is the bottleneck: {sample.model} at "
            f"ratio {sample.ratio} on {sample.topology} (K = 1) must move "
            f"{deficit / 1e9:.1f} GB each way per micro-batch if it only swaps; its best "
            f"swap-only plan takes {swap.iteration_s:.3f} s against {compute:.3f} s of "
            f"compute ({_pct(swap.iteration_s / compute - 1)}). {best.policy} recomputes "
            f"{len(gpu.recompute)} layers per GPU ({best.gpus[0].recompute_s:.3f} s of "
            f"forward per micro-batch), swaps {best.gpus[0].swapped_bytes / 1e9:.1f} GB and "
            f"takes {best.iteration_s:.3f} s ({_pct(best.iteration_s / compute - 1)} above "
            f"compute, {_pct(best.gap_to_best_bound)} above the best valid bound, whose "
            f"optimum recomputes {best.turn.recompute_s:.3f} s per micro-batch).",
        ]
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    worst = max(
        by_model, key=lambda m: statistics.mean(r.best.gap_to_best_bound for r in by_model[m])
    )
    worst_row = max(by_model[worst], key=lambda r: r.best.gap_to_best_bound)
    # save-on-cpu swaps every saved tensor: its plan lists them all.
    largest = max((s.bytes for s in worst_row.results["save-on-cpu"].plan.gpus[0].swaps), default=0)
    lines += [
        "",
        f"What remains above the best valid bound is largest for {worst} (worst case: "
        f"{worst_row.topology}, ratio {worst_row.ratio}, K = {worst_row.sync_every}, "
        f"{_pct(worst_row.best.gap_to_best_bound)}): its layers save tensors of up to "
        f"{largest / 1e9:.2f} GB that move whole, and recomputing one of its layers keeps "
        "that layer's whole input, while the bounds treat bytes and recomputed layers as "
        "a fluid (the fractional knapsack); a GPU alone already pays it (one-GPU table).",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced grid (seconds)")
    parser.add_argument("--no-write", action="store_true", help="print instead of writing")
    parser.add_argument("--out", default=str(RESULTS), help="results file (markdown)")
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else FULL
    started = time.perf_counter()
    load_start = _load()
    rows, single, refused = run_grid(grid)
    command = "python benchmarks/swap_policies.py" + (" --quick" if args.quick else "")
    text = report(
        rows, single, refused, grid, command, time.perf_counter() - started, (load_start, _load())
    )
    if args.no_write:
        print(text)
    else:
        write_atomic(args.out, text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
