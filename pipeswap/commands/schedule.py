"""`pipeswap schedule show`: print a pipeline schedule as a grid (and its actions/trace)."""

from __future__ import annotations

import argparse
import sys

from pipeswap.commands.json_out import print_json
from pipeswap.commands.options import add_options, given
from pipeswap.commands.settings import GridOptions, Outputs
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_writable
from pipeswap.pipeline.chrome import dump_chrome_trace
from pipeswap.pipeline.grid import render_grid
from pipeswap.schedule.kinds import schedule_kind
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.schedule.timetable import build_schedule, unit_time_order
from pipeswap.schedule.validate import validate
from pipeswap.train_config import TrainConfig

__all__ = [
    "DEFAULT_STEPS",
    "MAX_GRID_CELLS",
    "MAX_SCHEDULE_ACTIONS",
    "estimated_actions",
    "estimated_grid_cells",
    "register",
    "run",
]

# Every (stage, unit) pair costs up to six actions (RECV, F, SEND for the forward and again
# for the backward) plus an UPDATE per step; building, validating and printing them is
# linear in that count, so a bound on it keeps a typo like `--steps 100000` from running for
# minutes and growing to gigabytes. Two million actions take about ten seconds.
MAX_SCHEDULE_ACTIONS = 2_000_000
# The grid is one cell per stage and tick (a tick is one unit of --forward-cost or
# --backward-cost); a few characters per cell, so two million cells is about 12 MB of text.
MAX_GRID_CELLS = 2_000_000


# Mini-batches shown when --steps is not given.
DEFAULT_STEPS = 4
_HELPS = {
    "steps": f"mini-batches (default {DEFAULT_STEPS})",
    "micro_batches": "micro-batches per mini-batch for gpipe/1f1b (default: the number of stages)",
    "json": "print the schedule as JSON instead",
    "trace": "write a Chrome trace of the grid",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("schedule", help="show pipeline schedules as grids")
    actions = parser.add_subparsers(dest="schedule_command", metavar="ACTION")
    show = actions.add_parser("show", help="print the grid of a schedule")
    add_options(
        show, PipelineConfig, only=("schedule",), required=("schedule",), no_default=("schedule",)
    )
    add_options(show, GridOptions, only=("grid_stages",), required=("grid_stages",))
    add_options(show, TrainConfig, only=("steps",), helps=_HELPS)
    add_options(show, PipelineConfig, only=("micro_batches",), helps=_HELPS)
    add_options(show, GridOptions, only=("forward_cost", "backward_cost", "actions"))
    add_options(show, Outputs, only=("json", "trace"), helps=_HELPS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "schedule_command", None) != "show":
        raise PipeswapError("say what to do: `pipeswap schedule show --schedule 1f1b --stages 4`")
    _fill_defaults(args)
    micro = args.micro_batches
    if micro is None:
        micro = schedule_kind(args.schedule).default_micro_batches(args.stages)
    _check_sizes(args, micro)
    if args.trace is not None:
        _check_trace(args.trace)
    schedule = build_schedule(args.schedule, args.stages, args.steps, micro)
    validate(schedule)
    if args.json:
        print_json(schedule.to_json())
    else:
        print(
            render_grid(schedule, forward_cost=args.forward_cost, backward_cost=args.backward_cost)
        )
        if args.actions:
            print()
            print(schedule.to_string())
    if args.trace is not None:
        timeline = unit_time_order(
            schedule, forward_cost=args.forward_cost, backward_cost=args.backward_cost
        )
        dump_chrome_trace(args.trace, timeline, title=f"{schedule.name} ({args.stages} stages)")
        # With --json, stdout carries the JSON alone; the note goes to stderr.
        if args.json:
            print(f"Chrome trace written to {args.trace}", file=sys.stderr)
        else:
            print(f"\nChrome trace written to {args.trace}")
    return 0


def _fill_defaults(args: argparse.Namespace) -> None:
    """The grid's settings not given take GridOptions' defaults; --steps takes 4."""
    grid = GridOptions(**given(args, GridOptions))
    args.stages = grid.grid_stages
    args.forward_cost, args.backward_cost = grid.forward_cost, grid.backward_cost
    if args.steps is None:
        args.steps = DEFAULT_STEPS


def _check_trace(path: str) -> None:
    """Refuse a --trace that cannot be written before building the schedule."""

    if path == "":
        raise PipeswapError("--trace is empty; give a file name")
    check_writable(path)


def _check_sizes(args: argparse.Namespace, micro: int) -> None:
    """Refuse counts below 1 and schedules too large to build or print in seconds."""
    for flag, value in (
        ("--stages", args.stages),
        ("--steps", args.steps),
        ("--micro-batches", micro),
        ("--forward-cost", args.forward_cost),
        ("--backward-cost", args.backward_cost),
    ):
        if value < 1:
            raise PipeswapError(f"{flag} is {value}; use a whole number of at least 1")
    actions = estimated_actions(args.stages, args.steps, micro)
    if actions > MAX_SCHEDULE_ACTIONS:
        # Suggest the most steps that fit with the stages asked for, else a small example.
        steps_that_fit = MAX_SCHEDULE_ACTIONS // estimated_actions(args.stages, 1, micro)
        if steps_that_fit >= 1:
            smaller = f"--stages {args.stages} --steps {steps_that_fit}"
        else:
            smaller = "--stages 8 --steps 4" + (" --micro-batches 8" if args.micro_batches else "")
        raise PipeswapError(
            f"--stages {args.stages} --steps {args.steps} with {micro} micro-batches makes "
            f"about {actions:,} actions, more than this command shows "
            f"(MAX_SCHEDULE_ACTIONS = {MAX_SCHEDULE_ACTIONS:,}); try smaller values, e.g. "
            f"{smaller}"
        )
    if not args.json:
        cells = estimated_grid_cells(
            args.stages, args.steps, micro, args.forward_cost + args.backward_cost
        )
        if cells > MAX_GRID_CELLS:
            raise PipeswapError(
                f"the grid of --stages {args.stages} --steps {args.steps} with {micro} "
                f"micro-batches, --forward-cost {args.forward_cost} and --backward-cost "
                f"{args.backward_cost} has about {cells:,} cells, more than this command "
                f"prints (MAX_GRID_CELLS = {MAX_GRID_CELLS:,}); use smaller costs (e.g. "
                "--forward-cost 1 --backward-cost 2) or fewer steps, or --json for the "
                "actions alone"
            )


def estimated_actions(stages: int, steps: int, micro: int) -> int:
    """An upper bound on the actions of a schedule: six per stage and unit, one UPDATE per
    stage and unit (async-1f1b updates after every backward)."""
    return stages * steps * micro * 7


def estimated_grid_cells(stages: int, steps: int, micro: int, ticks_per_unit: int) -> int:
    """An upper bound on the grid's cells: a flushed mini-batch spans its units plus the
    pipeline's fill and drain, each unit ``ticks_per_unit`` ticks long."""
    return stages * steps * (micro + stages) * ticks_per_unit
