"""The grid shows warm-up, steady state, flush and bubbles where the closed forms say.

Covers: pipeswap/pipeline/grid.py.
"""

from __future__ import annotations

from pipeswap.pipeline.grid import render_grid
from pipeswap.schedule.timetable import build_schedule


def _rows(grid: str) -> dict[int, list[str]]:
    rows = {}
    for line in grid.splitlines():
        if line.startswith("stage ") and ":" not in line:
            parts = line.split()
            rows[int(parts[1])] = parts[2:]
    return rows


def test_gpipe_grid_places_each_pass_and_the_flush() -> None:
    stages, micro = 4, 4
    grid = render_grid(build_schedule("gpipe", stages, 2, micro))
    rows = _rows(grid)
    for k in range(stages):
        # Stage k idles k ticks (fill), then runs micro forwards.
        assert rows[k][:k] == ["."] * k
        assert rows[k][k : k + micro] == [f"F{u}" for u in range(micro)]
    # The last stage turns around immediately; stage 0 waits 2*(N-1) ticks for B0 (bubble).
    assert rows[3][7] == "B0"
    assert rows[0][micro : micro + 2 * (stages - 1)] == ["."] * 6
    assert "B3/U0" in rows[0] and "B7/U1" in rows[0]
    assert "flush + UPDATE" in grid
    # Bubble of one step: (N-1)/(M+N-1) = 3/7.
    assert "bubble 43%" in grid


def test_1f1b_grid_names_warm_up_steady_and_cool_down() -> None:
    grid = render_grid(build_schedule("1f1b", 4, 2, 4))
    for k in range(4):
        warm = 3 - k
        assert (
            f"stage {k}: per step warm-up {warm}F, steady {4 - warm}x(F,B), cool-down {warm}B"
            in grid
        )
    rows = _rows(grid)
    assert rows[3][3:7] == ["F0", "B0", "F1", "B1"]


def test_async_grid_has_no_flush_and_updates_after_every_backward() -> None:
    grid = render_grid(build_schedule("async-1f1b", 4, 8))
    rows = _rows(grid)
    assert rows[0][:4] == ["F0", "F1", "F2", "F3"]
    assert rows[0][7:10] == ["B0/U0", "F4", "B1/U1"]
    assert "flush" not in grid
    assert "stage 0: warm-up 3F, steady 5x(F,B), cool-down 3B" in grid


def test_backward_cost_spans_ticks_and_mark_brackets_a_cell() -> None:
    grid = render_grid(build_schedule("1f1b", 2, 1, 2), backward_cost=2, mark=(1, 2))
    rows = _rows(grid)
    assert rows[1][1:4] == ["F0", "[B0]", "~"]
