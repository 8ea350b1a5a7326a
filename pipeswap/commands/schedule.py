"""`pipeswap schedule show`: print a pipeline schedule as a grid (and its actions/trace)."""

from __future__ import annotations

import argparse
import json

from pipeswap.errors import PipeswapError
from pipeswap.pipeline.chrome import dump_chrome_trace
from pipeswap.pipeline.grid import render_grid
from pipeswap.pipeline.schedule import SCHEDULE_NAMES, build_schedule
from pipeswap.pipeline.validate import simulate, validate


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("schedule", help="show pipeline schedules as grids")
    actions = parser.add_subparsers(dest="schedule_command", metavar="ACTION")
    show = actions.add_parser("show", help="print the grid of a schedule")
    show.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    show.add_argument("--stages", type=int, required=True, help="pipeline stages (ranks)")
    show.add_argument("--steps", type=int, default=4, help="mini-batches (default 4)")
    show.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per mini-batch for gpipe/1f1b (default: the number of stages)",
    )
    show.add_argument("--forward-cost", type=int, default=1, help="time slots per forward")
    show.add_argument("--backward-cost", type=int, default=1, help="time slots per backward")
    show.add_argument("--actions", action="store_true", help="also print each rank's actions")
    show.add_argument("--json", action="store_true", help="print the schedule as JSON instead")
    show.add_argument("--trace", metavar="PATH", help="write a Chrome trace of the grid")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "schedule_command", None) != "show":
        raise PipeswapError("say what to do: `pipeswap schedule show --schedule 1f1b --stages 4`")
    micro = args.micro_batches
    if micro is None:
        micro = 1 if args.schedule == "async-1f1b" else args.stages
    schedule = build_schedule(args.schedule, args.stages, args.steps, micro)
    validate(schedule)
    if args.json:
        print(json.dumps(schedule.to_json(), indent=1))
        return 0
    print(render_grid(schedule, forward_cost=args.forward_cost, backward_cost=args.backward_cost))
    if args.actions:
        print()
        print(schedule.to_string())
    if args.trace:
        timeline = simulate(
            schedule, forward_cost=args.forward_cost, backward_cost=args.backward_cost
        )
        dump_chrome_trace(args.trace, timeline, title=f"{schedule.name} ({args.stages} stages)")
        print(f"\nChrome trace written to {args.trace}")
    return 0
