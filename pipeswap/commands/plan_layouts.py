"""`pipeswap plan --layouts`: the fastest layout that fits, its runner-ups, and how to run it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeswap.commands.json_out import print_json
from pipeswap.commands.options import add_options
from pipeswap.commands.settings import Outputs, PlanOptions
from pipeswap.commands.simulate import write_views
from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import Topology
from pipeswap.layouts.layout import DATA_PARALLEL, Layout
from pipeswap.layouts.search import LayoutSearch, family_summary, search_layouts
from pipeswap.profiling.profile import Profile
from pipeswap.units import format_bytes

__all__ = [
    "add_layout_arguments",
    "check_layout_arguments",
    "layouts_json",
    "layouts_table",
    "run_layouts",
    "train_command",
]


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("layouts (--layouts)")
    add_options(group, PlanOptions, only=("layouts",))
    add_options(group, Outputs, only=("layout_out",))


def run_layouts(
    args: argparse.Namespace, profile: Profile, topology: Topology, budget_bytes: int
) -> int:
    """Search, print the table (or JSON), write the outputs asked for."""
    search = search_layouts(profile, topology, budget_bytes)
    notes = sys.stderr if args.json else sys.stdout
    if args.json:
        print_json(layouts_json(search))
    else:
        print(layouts_table(search, profile, budget_bytes))
    best = search.best
    if args.layout_out:
        best.layout.save(args.layout_out)
        print(f"wrote layout {args.layout_out}", file=notes)
    write_views(args, best.graph, best.result, best.topology, notes)
    if args.graph_out:
        best.graph.save(args.graph_out)
        print(
            f"wrote graph {args.graph_out}; reproduce with: pipeswap simulate --graph "
            f"{args.graph_out} --topology {args.topology} --gpu-memory {budget_bytes}",
            file=notes,
        )
    return 0


def layouts_json(search: LayoutSearch) -> dict[str, Any]:
    return {
        "best": search.best.layout.to_json(),
        "families": {
            s.layout.family: s.layout.to_json() for _, s in family_summary(search) if s is not None
        },
        "smallest_budget_bytes": search.smallest_bytes,
        "layouts_fitting": len(search.scored),
    }


def layouts_table(search: LayoutSearch, profile: Profile, budget_bytes: int) -> str:
    best = search.best.layout
    gpus = max(s.layout.gpus for s in search.scored)
    lines = [
        f"layouts of {profile.model} on {best.topology} within {format_bytes(budget_bytes)} "
        f"per GPU, {profile.batch} samples per GPU per step ({gpus * profile.batch} in all): "
        f"{len(search.scored)} fit",
        "",
        f"best: {best.name}: {best.samples_per_s:,.2f} samples/s, peak "
        f"{format_bytes(best.peak_bytes)}",
        "run it: " + train_command(best, profile),
    ]
    lines += ["", f"{'family':<32} {'fastest':<40} {'samples/s':>10} {'vs best':>8} {'peak':>10}"]
    for title, scored in family_summary(search):
        if scored is None:
            lines.append(f"{title:<32} {'none fits':<40}")
            continue
        layout = scored.layout
        ratio = layout.samples_per_s / best.samples_per_s
        lines.append(
            f"{title:<32} {layout.name:<40} {layout.samples_per_s:>10,.2f} {ratio:>7.3f}x "
            f"{format_bytes(layout.peak_bytes):>10}"
        )
    uncoordinated = search.best_swapping(coordinated=False)
    coordinated = search.best_swapping(coordinated=True)
    if uncoordinated is not None and coordinated is not None:
        gain = coordinated.layout.samples_per_s / uncoordinated.layout.samples_per_s
        lines.append(
            f"stages that swap, coordinated over switches ({coordinated.layout.name}): "
            f"{gain:.3f}x the uncoordinated ({uncoordinated.layout.name}: Mobius mapping, "
            "each stage alone)"
        )
    if best.family != DATA_PARALLEL:
        lines += ["", "stages of the best:"]
        for plan in best.stage_plans:
            lines.append(
                f"  stage {plan.stage}: {_layers(len(plan.layers))} ({plan.layers[0]}..."
                f"{plan.layers[-1]}), swaps {_layers(len(plan.swapped))}, recomputes "
                f"{_layers(len(plan.recomputed))}, peak {format_bytes(plan.peak_bytes)}"
            )
    return "\n".join(lines)


def _layers(count: int) -> str:
    return "none" if count == 0 else f"{count} layer" + ("" if count == 1 else "s")


def train_command(layout: Layout, profile: Profile) -> str:
    """The `pipeswap train` line that runs ``layout`` (the model's shape flags included)."""
    words = ["pipeswap train", f"--model {layout.model}"]
    if profile.seq_len:
        words.append(f"--seq-len {profile.seq_len}")
    if profile.image_size:
        words.append(f"--image-size {profile.image_size}")
    if layout.family == DATA_PARALLEL:
        words += [
            f"--batch {layout.batch}",
            f"--nproc {layout.replicas}",
            f"--swap-policy {layout.swap_policy}",
            f"--gpu-memory {layout.budget_bytes}",
        ]
        return " ".join(words)
    mini_batch = layout.samples_per_step // layout.replicas
    words += [
        f"--batch {mini_batch}",
        f"--pipeline {layout.stages}",
        f"--balance {','.join(map(str, layout.balance))}",
        f"--schedule {layout.schedule}",
        f"--weights {layout.weights}",
    ]
    if layout.micro_batches > 1:
        words.append(f"--micro-batches {layout.micro_batches}")
    words.append(f"--nproc {layout.gpus}")
    if layout.swaps:
        words += ["--swap-policy hybrid", f"--gpu-memory {layout.budget_bytes}"]
    return " ".join(words)


def check_layout_arguments(args: argparse.Namespace) -> None:
    if args.layout_out is not None and not args.layouts:
        raise PipeswapError("--layout-out writes the layout --layouts finds; add --layouts")
    if args.layouts and (args.policy is not None or args.compare or args.out is not None):
        raise PipeswapError(
            "--layouts searches every family itself: drop --policy, --compare and --out "
            "(write the layout with --layout-out FILE)"
        )
    if args.layouts and args.footprint_ratio is not None:
        raise PipeswapError(
            "--layouts compares layouts with different peaks, so a footprint ratio names no "
            "budget: give --gpu-memory SIZE (default: the topology's GPU memory)"
        )
    if args.layouts and (args.gpus is not None or args.accumulate is not None):
        raise PipeswapError(
            "--layouts lays the job out on every GPU of the topology, one update per step: "
            "drop --gpus and --accumulate (or give a topology with the GPUs to use)"
        )
