"""Which no-flush pipeline trains as well as a synchronous one? Every schedule and weight mode.

Run from the repository root:

    .venv/bin/python benchmarks/pipeline_modes.py                      # K = 4 and 8, ~20 min
    .venv/bin/python benchmarks/pipeline_modes.py --quick --out /tmp/modes.md
    .venv/bin/python benchmarks/pipeline_modes.py --load-records runs.json  # re-render saved runs

The tasks, models, learning rates and seeds are pipeline_convergence.py's (byte-level LM
with an 8-block GPT; procedural images with a CIFAR-style ResNet); every run is the
emulator, and every mode trains the same samples. Modes: synchronous 1F1B (the reference),
``async-1f1b`` with ``stale``, ``stash`` and prediction (``spectrain`` / ``predict-adam``),
``2bw`` (PipeDream-2BW: a delay of one update at every stage) with ``stash`` and prediction,
and ``nesterov`` (arXiv 2505.01099 as released: stashing + NAdamW, beta1 0.99; Adam family
only). The prediction runs as pipeswap's defaults have it, with the stability rule on (each
stage steps at lr / (1 + tau)^2 and clips a spike of its gradient norm; the other modes
without it: docs/concepts.md), and again with the rule off ("rule off"). "Recovers" is (stale - mode) / (stale - sync) in held-out loss, from the means over
seeds, with the range of the per-seed ratios; "weight copies" is what the mode keeps per
stage beyond the live weights, at the stage that keeps most
(pipeswap.schedule.partition.extra_weight_copies).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, emulate, header, mean_std, run_jobs
from pipeline_convergence import TASKS, Mode, Setting, _config

from pipeswap.jsonio import dump_json, write_atomic

RESULTS = RESULTS_DIR / "pipeline_modes.md"
ABOUT = (__doc__ or "").split("\n\n", 3)[3].strip()
RECORDS_FORMAT = "pipeswap.bench-modes/1"
NESTEROV_MOMENTUM = 0.99  # what the authors' released run script uses


@dataclass(frozen=True)
class Row:
    """One mode of the table: its Mode (for the config), the momentum it runs with, and its
    delay_lr_power (None: the mode's default; 0 turns the stability rule off)."""

    mode: Mode
    momentum: float = 0.9
    power: float | None = None


ROWS = (
    Row(Mode("sync 1f1b", "1f1b", "stale", "sgd")),
    Row(Mode("stale", "async-1f1b", "stale", "sgd")),
    Row(Mode("stash", "async-1f1b", "stash", "sgd")),
    Row(Mode("spectrain", "async-1f1b", "spectrain", "sgd")),
    Row(Mode("spectrain, rule off", "async-1f1b", "spectrain", "sgd"), power=0.0),
    Row(Mode("2bw stash", "2bw", "stash", "sgd")),
    Row(Mode("2bw spectrain", "2bw", "spectrain", "sgd")),
    Row(Mode("2bw spectrain, rule off", "2bw", "spectrain", "sgd"), power=0.0),
    Row(Mode("sync 1f1b", "1f1b", "stale", "adam")),
    Row(Mode("stale", "async-1f1b", "stale", "adam")),
    Row(Mode("stash", "async-1f1b", "stash", "adam")),
    Row(Mode("predict-adam", "async-1f1b", "predict-adam", "adam")),
    Row(Mode("predict-adam, rule off", "async-1f1b", "predict-adam", "adam"), power=0.0),
    Row(Mode("2bw stash", "2bw", "stash", "adam")),
    Row(Mode("2bw predict-adam", "2bw", "predict-adam", "adam")),
    Row(Mode("2bw predict-adam, rule off", "2bw", "predict-adam", "adam"), power=0.0),
    # As released: without the stability rule pipeswap now keeps on for it by default
    # (docs/results/pipeline_robustness.md measures it with the rule).
    Row(Mode("nesterov", "async-1f1b", "nesterov", "adamw"), NESTEROV_MOMENTUM, power=0.0),
)


def config_of(setting: Setting, row: Row, seed: int) -> Any:
    from pipeswap.config_fields import replace_fields

    config = _config(setting, row.mode, seed)
    # Adam's learning rate for AdamW too (nesterov): the same step size as the Adam rows.
    lr = setting.lr("adam" if row.mode.optimizer == "adamw" else row.mode.optimizer)
    return replace_fields(config, momentum=row.momentum, lr=lr, delay_lr_power=row.power)


def run_one(job: tuple[Setting, Row, int]) -> dict[str, Any]:
    import time

    setting, row, seed = job
    started = time.perf_counter()
    run = emulate(config_of(setting, row, seed), record=False)
    return {
        "setting": setting.key,
        "label": row.mode.label,
        "optimizer": row.mode.optimizer,
        "seed": seed,
        "losses": run["losses"],
        "eval": run["eval"],
        "wall_s": time.perf_counter() - started,
    }


def weight_copies(row: Row, stages: int) -> int:
    from pipeswap.schedule.kinds import schedule_kind
    from pipeswap.schedule.partition import extra_weight_copies

    in_flight = stages - 1 if row.mode.schedule == "async-1f1b" else 1
    if not schedule_kind(row.mode.schedule).asynchronous:
        return 0
    return extra_weight_copies(row.mode.weights, in_flight, row.mode.schedule)


def _family(optimizer: str) -> str:
    return "sgd" if optimizer == "sgd" else "adam"


def table(
    setting: Setting, records: list[dict[str, Any]]
) -> tuple[str, dict[str, tuple[float, float]]]:
    """The markdown table of one setting, and per family/label: (recovery, loss - sync)."""
    mine = [r for r in records if r["setting"] == setting.key]
    lines = [
        f"### {setting.title}\n",
        "| optimizer | mode | held-out loss (mean ± std) | recovers (seed range) | "
        "weight copies per stage |",
        "|---|---|---:|---:|---:|",
    ]
    best: dict[str, tuple[float, float]] = {}
    for family in ("sgd", "adam"):
        rows = [row for row in ROWS if _family(row.mode.optimizer) == family]
        by_label = {
            row.mode.label: sorted(
                (
                    r
                    for r in mine
                    if r["label"] == row.mode.label and _family(r["optimizer"]) == family
                ),
                key=lambda r: r["seed"],
            )
            for row in rows
        }
        loss = {k: [_held_out(r) for r in v] for k, v in by_label.items()}
        sync, stale = loss["sync 1f1b"], loss["stale"]
        for row in rows:
            values = loss[row.mode.label]
            if not values:
                continue
            mean, std = _mean_std(values)
            recovered, spread = _recovery(sync, stale, values)
            if row.mode.label not in ("sync 1f1b", "stale") and math.isfinite(recovered):
                best[f"{family}/{row.mode.label}"] = (recovered, mean - _mean_std(sync)[0])
            shown = "-" if row.mode.label in ("sync 1f1b", "stale") else spread
            lines.append(
                f"| {row.mode.optimizer} | {row.mode.label} | {_shown_loss(values, mean, std)} | "
                f"{shown} | {weight_copies(row, setting.stages)} |"
            )
    return "\n".join(lines) + "\n", best


def _shown_loss(values: list[float], mean: float, std: float) -> str:
    diverged = sum(not math.isfinite(v) for v in values)
    if diverged:
        return f"diverged ({diverged} of {len(values)} seeds)"
    return f"{mean:.4f} ± {std:.4f}"


def _held_out(record: dict[str, Any]) -> float:
    value = record["eval"].get("loss", math.nan)
    return value if math.isfinite(value) else math.inf


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and spread; a diverged seed (infinite loss) makes the mean infinite."""
    if any(not math.isfinite(v) for v in values):
        return math.inf, math.nan
    return mean_std(values)


def _recovery(sync: list[float], stale: list[float], mode: list[float]) -> tuple[float, str]:
    if not sync or not stale or not mode:
        return math.nan, "-"
    gap = _mean_std(stale)[0] - _mean_std(sync)[0]
    if math.isnan(gap) or gap <= 0:
        return math.nan, "no gap"
    if gap == math.inf:  # stale diverged: a mode that does not recovers all of the gap
        finite = math.isfinite(_mean_std(mode)[0])
        return (1.0 if finite else math.nan), ("100% (stale diverged)" if finite else "diverged")
    if not math.isfinite(_mean_std(mode)[0]):
        return math.nan, "diverged"
    recovered = (_mean_std(stale)[0] - _mean_std(mode)[0]) / gap
    per_seed = [
        (a - m) / (a - s)
        for s, a, m in zip(sync, stale, mode)
        if a - s > 0 and math.isfinite(a - s) and math.isfinite(m)
    ]
    low, high = (min(per_seed), max(per_seed)) if per_seed else (math.nan, math.nan)
    return recovered, f"{_pct(recovered)} ({_pct(low)} to {_pct(high)})"


def _pct(value: float) -> str:
    return f"{100 * value + 0.0:.0f}%".replace("-0%", "0%")


def plot(setting: Setting, records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, family in zip(axes, ("sgd", "adam")):
        for row in ROWS:
            if _family(row.mode.optimizer) != family:
                continue
            runs = [
                r
                for r in records
                if r["setting"] == setting.key
                and r["label"] == row.mode.label
                and _family(r["optimizer"]) == family
            ]
            if not runs:
                continue
            steps = len(runs[0]["losses"])
            mean = [sum(r["losses"][i] for r in runs) / len(runs) for i in range(steps)]
            window = max(1, steps // 20)
            smooth = [
                sum(mean[max(0, i - window + 1) : i + 1])
                / len(mean[max(0, i - window + 1) : i + 1])
                for i in range(steps)
            ]
            ax.plot(smooth, label=row.mode.label)
        ax.set_title(f"{setting.title}: {family}")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("training loss (moving mean over seeds)")
    fig.tight_layout()
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def _without_records(argv: list[str]) -> list[str]:
    """The command that regenerates the page: the records options only cache the runs."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--save-records", "--load-records"):
            skip = True
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny steps and one seed (tests)")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS))
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--save-records",
        type=Path,
        metavar="JSON",
        help="keep every run's record here (to re-render with --load-records)",
    )
    parser.add_argument(
        "--load-records",
        type=Path,
        metavar="JSON",
        help="render the page from saved records instead of training",
    )
    args = parser.parse_args(argv)
    tasks = [TASKS[name] for name in args.tasks]
    if args.quick:
        tasks = [dataclasses.replace(t, steps=6, eval_batches=1) for t in tasks]
        args.seeds, args.stages = 1, [4]
    settings = [Setting(task, k) for k in args.stages for task in tasks]
    work = [(s, row, seed) for s in settings for row in ROWS for seed in range(args.seeds)]
    if args.load_records is not None:
        # Diverged runs have NaN losses: the records are this script's own, read as written.
        saved = json.loads(args.load_records.read_text())
        if saved.get("format") != RECORDS_FORMAT:
            parser.error(f"{args.load_records} is not a {RECORDS_FORMAT} file")
        records = saved["records"]
    else:
        kept: list[dict[str, Any]] = []

        def keep(record: dict[str, Any]) -> None:
            kept.append(record)
            if args.save_records is not None:
                dump_json(args.save_records, {"format": RECORDS_FORMAT, "records": kept})

        records = run_jobs(
            work,
            run_one,
            args.jobs,
            on_record=keep,
            describe=lambda r: f"{r['setting']} {r['optimizer']} {r['label']} seed {r['seed']}",
        )
    shown = _without_records(argv if argv is not None else sys.argv[1:])
    parts = [
        header(
            "Every schedule and weight mode: held-out loss, recovery, memory",
            "pipeline_modes.py",
            shown,
        )
    ]
    parts.append(ABOUT + "\n\n")
    summary = []
    for setting in settings:
        text, best = table(setting, records)
        picture = args.out.with_name(f"{args.out.stem}_{setting.key}.png")
        plot(setting, records, picture)
        parts.append(text + f"\n![{setting.title}]({picture.name})\n\n")
        for family in ("sgd", "adam"):
            mine = {k: v for k, v in best.items() if k.startswith(family + "/")}
            if mine:
                # The lowest held-out loss: with a diverged stale run every finite mode
                # "recovers" 100%, and the loss above sync tells them apart.
                name, (value, above) = min(mine.items(), key=lambda kv: kv[1][1])
                summary.append(
                    f"| {setting.title} | {family} | {name.split('/', 1)[1]} | "
                    f"{_pct(value)} | {above:+.4f} |"
                )
    parts.insert(
        2,
        "## Best no-flush mode per setting\n\n| setting | optimizer | mode | "
        "recovers | held-out loss above sync |\n|---|---|---|---:|---:|\n"
        + "\n".join(summary)
        + "\n\n",
    )
    write_atomic(args.out, "".join(parts))
    print("".join(parts[2:3]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
