"""Text grid of a schedule: one row per stage, one column per tick."""

from __future__ import annotations

from pipeswap.errors import PipeswapError
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import Schedule, TimedAction, unit_time_order

__all__ = ["IDLE", "phase_summary", "render_grid"]

IDLE = "."


def render_grid(
    schedule: Schedule,
    *,
    forward_cost: int = 1,
    backward_cost: int = 1,
    mark: tuple[int, float] | None = None,
) -> str:
    """The schedule on an idealized machine (F, B of integer cost; UPDATE and transfers free).

    A cell ``F3`` is the forward of unit 3, ``B3/U1`` a backward followed by the update of
    mini-batch 1, ``~`` the continuation of a multi-tick pass, ``.`` an idle tick (bubble).
    ``mark=(stage, time)`` brackets one cell, e.g. to point at a failing step. Below the grid,
    one line per stage names its warm-up, steady state and cool-down (and, for synchronous
    schedules, the flush before each update) and its bubble fraction.
    """
    if forward_cost < 1 or backward_cost < 1:
        raise PipeswapError("grid costs must be whole ticks of at least 1")
    timeline = unit_time_order(schedule, forward_cost=forward_cost, backward_cost=backward_cost)
    makespan = int(max((t.end for t in timeline), default=0))
    cells = [[IDLE] * makespan for _ in range(schedule.num_stages)]
    last_tick: dict[int, int] = {}
    for timed in timeline:
        _place(cells[timed.stage], timed, last_tick)
    if mark is not None and 0 <= int(mark[1]) < makespan:
        mark_row, mark_col = mark[0], int(mark[1])
        cells[mark_row][mark_col] = f"[{cells[mark_row][mark_col]}]"
    width = max(3, *(len(c) + 1 for row in cells for c in row)) if makespan else 3
    label = f"stage {schedule.num_stages - 1}"
    header = " " * len(label) + " " + "".join(f"{t:<{width}}" for t in range(makespan))
    unit_word = "micro-batches" if schedule.micro_batches > 1 else "mini-batches"
    title = (
        f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_steps} steps, "
        f"{schedule.num_units} {unit_word} (F={forward_cost}, B={backward_cost} ticks)"
    )
    lines = [title, header.rstrip()]
    for stage, row in enumerate(cells):
        name = f"stage {stage}".ljust(len(label))
        lines.append((name + " " + "".join(f"{c:<{width}}" for c in row)).rstrip())
    lines.append("")
    lines += [phase_summary(schedule, stage, cells[stage]) for stage in range(schedule.num_stages)]
    return "\n".join(lines)


def _place(row: list[str], timed: TimedAction, last_tick: dict[int, int]) -> None:
    act = timed.action
    if act.kind is ActionKind.UPDATE:
        tick = last_tick.get(timed.stage)
        if tick is not None:
            row[tick] += f"/U{act.unit}"
        return
    if not act.kind.is_pass:
        return
    start, end = int(timed.start), int(timed.end)
    row[start] = f"{act.kind}{act.unit}"
    for t in range(start + 1, end):
        row[t] = "~"
    last_tick[timed.stage] = start


def phase_summary(schedule: Schedule, stage: int, row: list[str]) -> str:
    """``stage 1: warm-up 2F, steady 2x(F,B), cool-down 2B, flush+UPDATE; bubble 33%``.

    The phases are the schedule's own caption (ScheduleKind.caption); the bubble is the
    idle share of the stage's ``row`` of grid cells.
    """
    body = schedule.kind.caption(schedule.compute_actions(stage), schedule.micro_batches)
    idle = sum(1 for c in row if c == IDLE)
    bubble = idle / len(row) if row else 0.0
    return f"stage {stage}: {body}; bubble {bubble:.0%}"
