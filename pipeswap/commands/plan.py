"""`pipeswap plan`: choose which activations each GPU swaps to host memory, and when."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeswap.commands.json_out import print_json
from pipeswap.commands.options import add_options, given, message
from pipeswap.commands.plan_layouts import (
    add_layout_arguments,
    check_layout_arguments,
    run_layouts,
)
from pipeswap.commands.settings import Outputs, PlanOptions
from pipeswap.commands.simulate import write_views
from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.detect import named_topology
from pipeswap.hardware.presets import topology_file
from pipeswap.jsonio import check_writable
from pipeswap.models import model_spec
from pipeswap.optim import OptimizerConfig
from pipeswap.profiling.estimate import estimate
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.profile_config import DEFAULT_GPU, ProfileConfig
from pipeswap.swap.plan.planner import PlanResult, make_case, plan_case
from pipeswap.swap.swap_config import POLICY_KINDS, POLICY_NAMES, SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.units import format_bytes

__all__ = ["best_fitting", "compare", "compare_table", "plan_table", "register", "run"]

_HELPS = {
    "profile_path": "a pipeswap.profile/1 JSON file (`pipeswap profile ... --out`); or {estimate}",
    "model": "the model {estimate} estimates, when {estimate} names none",
    "batch": "samples per GPU for {estimate} (default: the model's)",
    "seq_len": "tokens per sample for {estimate} (default: the model's)",
    "image_size": "image side in pixels for {estimate} (default: the model's)",
    "topology": "a preset (switch-4, single-root-8, dual-root-8, ...), a JSON file, or "
    "detect (this machine's GPUs)",
    "out": "write the pipeswap.swapplan/2 plan",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan activation swapping (and recomputation) for data-parallel training on a "
        "PCIe server",
        description="Decide, for every GPU of a data-parallel job, which saved activations go "
        "to host memory and when, aware of GPUs that share a PCIe channel, and (hybrid, mip, "
        "auto) which layers to recompute instead; score the plan with the simulator.",
    )
    source = parser.add_argument_group("the profile (--profile FILE, or --estimate MODEL)")
    add_options(source, TrainConfig, only=("profile_path",), helps=_HELPS)
    add_options(source, ProfileConfig, only=("estimate",))
    add_options(source, TrainConfig, only=("model", "batch"), helps=_HELPS)
    shape = source.add_mutually_exclusive_group()
    add_options(shape, TrainConfig, only=("seq_len", "image_size"), helps=_HELPS)
    add_options(source, ProfileConfig, only=("gpu",))
    add_options(parser, TrainConfig, only=("topology",), required=("topology",), helps=_HELPS)
    add_options(parser, PlanOptions, only=("gpus",))
    # plan asks for a policy (or --compare): its help shows no default.
    add_options(parser, SwapConfig, no_default=("policy",))
    add_options(parser, OptimizerConfig, only=("accumulate",))
    add_options(parser, PlanOptions, only=("compare",))
    add_options(
        parser, Outputs, only=("out", "graph_out", "trace", "timeline", "json"), helps=_HELPS
    )
    add_layout_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_layout_arguments(args)
    if args.layouts:
        config = SwapConfig(**given(args, SwapConfig))
        _check_outputs(args)
        profile = _profile(args)
        topology = named_topology(args.topology)
        topology.require_gpus(args.topology)
        budget = config.gpu_memory_bytes or min(
            topology.node(g).memory_bytes for g in topology.gpus
        )
        return run_layouts(args, profile, topology, budget)
    if args.policy is not None and args.compare:
        raise PipeswapError(
            f"--policy {args.policy} and --compare exclude each other: give --policy NAME "
            "(one policy) or --compare (every policy), not both"
        )
    if args.policy is None and not args.compare:
        raise PipeswapError(
            f"give --policy NAME ({', '.join(POLICY_NAMES)}) or --compare (every policy)"
        )
    config = SwapConfig(**given(args, SwapConfig))
    _check_outputs(args)
    profile = _profile(args)
    topology = named_topology(args.topology)
    topology.require_gpus(args.topology)
    accumulate = OptimizerConfig(**given(args, OptimizerConfig)).accumulate
    case = make_case(profile, topology, config, gpus=args.gpus, sync_every=accumulate)
    notes = sys.stderr if args.json else sys.stdout
    if args.compare:
        results, refused = compare(case, profile, time_limit_s=config.time_limit_s)
        chosen = best_fitting(results)
        said = {policy: message(exc) for policy, exc in refused.items()}
        if args.json:
            print_json(
                {
                    "policies": [r.to_json() for r in results],
                    "refused": said,
                    "best": chosen.policy,
                }
            )
        else:
            print(compare_table(results, said))
    else:
        chosen = plan_case(case, profile, config.policy, time_limit_s=config.time_limit_s)
        if args.json:
            print_json(chosen.to_json())
        else:
            print(plan_table(chosen))
    _write_outputs(args, chosen, notes)
    return 0


def _profile(args: argparse.Namespace) -> Profile:
    """The profile file, or the estimate --estimate asks for (one of them)."""
    if (args.profile_path is None) == (args.estimate is None):
        raise PipeswapError(
            "give the profile as --profile FILE or --estimate MODEL [--batch N --gpu SPEC], "
            "one of them"
        )
    if args.profile_path is None:
        model = args.estimate or args.model
        if model is None:
            raise PipeswapError("--estimate needs the model: write --estimate MODEL")
        if args.estimate and args.model not in (None, args.estimate):
            raise PipeswapError(
                f"--estimate {args.estimate} and --model {args.model} name two models; "
                f"write --estimate {args.estimate} alone"
            )
        for flag, value in (
            ("--batch", args.batch),
            ("--seq-len", args.seq_len),
            ("--image-size", args.image_size),
        ):
            if value is not None and value < 1:
                raise PipeswapError(
                    f"{flag} is {value}; use a whole number >= 1 (or leave it out for the "
                    "model's default)"
                )
        spec = model_spec(model)
        spec.task_entry.check_sizes(
            model, args.seq_len, args.image_size, tokens=bool(spec.reads_tokens)
        )
        return estimate(
            model,
            args.batch or spec.default_batch or 8,
            seq_len=args.seq_len,
            image_size=args.image_size,
            gpu=args.gpu or DEFAULT_GPU,
        )
    if any(
        value is not None
        for value in (args.batch, args.gpu, args.model, args.seq_len, args.image_size)
    ):
        raise PipeswapError(
            "--batch, --seq-len, --image-size, --gpu and --model apply to --estimate; drop "
            "them with --profile"
        )
    return Profile.load(args.profile_path)


def compare(
    case: Any, profile: Profile, *, time_limit_s: float
) -> tuple[list[PlanResult], dict[str, ConfigError]]:
    """Every policy on one case (``auto`` starts from the MIP's answer, solved once), and
    the refusals of the policies that cannot plan for its budget (a comparison goes on
    without them); when every policy refuses, the first refusal is raised."""
    results: list[PlanResult] = []
    refused: dict[str, ConfigError] = {}
    for policy in POLICY_KINDS:
        try:
            results.append(plan_case(case, profile, policy, time_limit_s=time_limit_s))
        except ConfigError as exc:
            refused[policy] = exc
    if not results:
        raise next(iter(refused.values()))
    return results, refused


def best_fitting(results: list[PlanResult]) -> PlanResult:
    """The fastest plan that fits its budget; a clear error when none does."""
    fitting = [r for r in results if r.fits]
    if not fitting:
        budget = format_bytes(results[0].budget_bytes)
        raise PipeswapError(
            f"no policy plans a step that fits {budget} per GPU: give a larger --gpu-memory "
            "(or a smaller --footprint-ratio); --policy NAME names the smallest budget it plans"
        )
    return min(fitting, key=lambda r: r.iteration_s)


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before planning, any output that cannot be written, that would overwrite an
    input, or that is given twice; so no file is written and then another one refused."""

    named = [
        ("--out", args.out),
        ("--graph-out", args.graph_out),
        ("--trace", args.trace),
        ("--timeline", args.timeline),
        ("--layout-out", args.layout_out),
    ]
    inputs = (args.profile_path, topology_file(args.topology))
    for i, (flag, path) in enumerate(named):
        if path == "":
            raise PipeswapError(f"{flag} is empty; give a file name")
        if path is not None:
            check_writable(path, inputs=inputs, outputs=[other for _, other in named[i + 1 :]])


def _write_outputs(args: argparse.Namespace, chosen: PlanResult, notes: Any) -> None:
    which = f" ({chosen.policy})" if args.compare else ""
    if args.out is not None:
        chosen.plan.save(args.out)
        print(f"wrote plan{which} {args.out}", file=notes)
    if args.graph_out is not None:
        chosen.graph.save(args.graph_out)
        print(
            f"wrote graph{which} {args.graph_out}; reproduce with: pipeswap simulate --graph "
            f"{args.graph_out} --topology {args.topology or chosen.topology.name} --gpu-memory "
            f"{chosen.simulated_memory_bytes}",
            file=notes,
        )
    write_views(args, chosen.graph, chosen.result, chosen.topology, notes)


def _gap(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def plan_table(result: PlanResult) -> str:
    """The human report of one plan: the headline numbers, then one row per GPU."""
    lines = [
        f"policy         {result.policy}" + ("" if result.fits else "  (DOES NOT FIT)"),
        f"iteration_s    {result.iteration_s:.4f}",
        f"compute_s      {result.compute_s:.4f}",
        f"lower_bound_s  {result.lower_bound_s:.4f}  (binding: {result.bound.binding}; "
        f"plan is {_gap(result.gap_to_bound)} above)",
        f"turn_bound_s   {result.turn_bound_s:.4f}  (binding: {result.turn.binding}; "
        f"plan is {_gap(result.iteration_s / result.turn_bound_s - 1)} above)",
        f"solve_s        {result.solve_s:.3f}",
        f"mip_gap        {_gap(result.mip_gap)}",
    ]
    for key, value in result.notes.items():
        if key not in ("mip_gap",):
            lines.append(f"{key:<14} {value}")
    lines.append("")
    header = (
        f"{'gpu':<8} {'peak':>11} {'budget':>11} {'swapped':>11} {'stall_s':>9} "
        f"{'offset_s':>9} {'recomputed':>10} {'recomp_s':>8}"
    )
    lines.append(header)
    for g in result.gpus:
        lines.append(
            f"{g.gpu:<8} {format_bytes(g.peak_bytes):>11} {format_bytes(g.budget_bytes):>11} "
            f"{format_bytes(g.swapped_bytes):>11} {g.stall_s:>9.4f} {g.offset_s:>9.4f} "
            f"{g.recomputed_layers:>10} {g.recompute_s:>8.4f}"
        )
    return "\n".join(lines)


def compare_table(results: list[PlanResult], refused: dict[str, str] | None = None) -> str:
    """One row per policy, with the speedup over the contention-oblivious baseline; then
    the policies that refused the budget, each with its reason."""
    baseline = next((r for r in results if r.policy == "oblivious"), None)
    best = best_fitting(results)
    # "vs bound": the gap to the best bound known, max(link bound, turn bound).
    header = (
        f"{'policy':<20} {'iteration_s':>11} {'vs oblivious':>12} {'vs bound':>9} "
        f"{'solve_s':>8} {'mip_gap':>8} {'max peak':>11} {'swapped':>11} {'stall_s':>8} "
        f"{'recomputed':>10}"
    )
    lines = [header]
    for r in results:
        speedup = (
            "-"
            if baseline is None or not r.fits
            else (f"{baseline.iteration_s / r.iteration_s:.3f}x")
        )
        name = r.policy + ("" if r.fits else " (no fit)")
        # The bounds hold for plans within the budget: one beyond it may run faster.
        bound_gap = _gap(r.gap_to_best_bound) if r.fits else "-"
        lines.append(
            f"{name:<20} {r.iteration_s:>11.4f} {speedup:>12} {bound_gap:>9} "
            f"{r.solve_s:>8.3f} {_gap(r.mip_gap):>8} "
            f"{format_bytes(max(g.peak_bytes for g in r.gpus)):>11} "
            f"{format_bytes(max(g.swapped_bytes for g in r.gpus)):>11} "
            f"{max(g.stall_s for g in r.gpus):>8.4f} "
            f"{max(g.recomputed_layers for g in r.gpus):>10}"
        )
    for policy, reason in (refused or {}).items():
        lines.append(f"{policy + ' (refused)':<20} {reason}")
    lines.append(
        f"best: {best.policy} ({best.iteration_s:.4f} s); lower bound "
        f"{best.lower_bound_s:.4f} s, turn bound {best.turn_bound_s:.4f} s; budget "
        f"{format_bytes(best.budget_bytes)} per GPU"
    )
    return "\n".join(lines)
