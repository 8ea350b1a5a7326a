"""`pipeswap schedule show` prints the grid and refuses bad requests with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeswap.cli import main


def test_show_async_grid(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["schedule", "show", "--schedule", "async-1f1b", "--stages", "4", "--steps", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("\nstage ") >= 8
    assert "stage 0 F0    F1    F2    F3" in out
    assert "warm-up 3F" in out and "UPDATE after every B" in out


def test_show_sync_grid_with_actions_and_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.json"
    argv = [
        "schedule",
        "show",
        "--schedule",
        "1f1b",
        "--stages",
        "4",
        "--steps",
        "2",
        "--actions",
        "--trace",
        str(trace),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "flush + UPDATE" in out
    assert "0: 0F0 0SEND_F0 0F1" in out
    assert json.loads(trace.read_text())["traceEvents"]


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "show", "--schedule", "gpipe", "--stages", "2", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["format"] == "pipeswap.schedule/1" and obj["micro_batches"] == 2


def test_async_with_micro_batches_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["schedule", "show", "--schedule", "async-1f1b", "--stages", "2", "--micro-batches", "4"]
    assert main(argv) == 2
    assert "--schedule 1f1b" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--stages", "0"], "--stages is 0; use a whole number of at least 1"),
        (["--stages", "-3"], "--stages is -3; use a whole number of at least 1"),
        (["--stages", "2", "--steps", "0"], "--steps is 0; use a whole number of at least 1"),
        (["--stages", "2", "--steps", "-1"], "--steps is -1"),
        (["--stages", "2", "--micro-batches", "0"], "--micro-batches is 0"),
        (["--stages", "2", "--forward-cost", "0"], "--forward-cost is 0"),
        (["--stages", "100000", "--steps", "100000"], "MAX_SCHEDULE_ACTIONS = 2,000,000"),
        (["--stages", "100000", "--steps", "100000"], "try smaller values, e.g. --stages 8"),
        (["--stages", "100", "--steps", "100"], "e.g. --stages 100 --steps 28"),
        (["--stages", "4", "--steps", "2", "--forward-cost", "100000"], "MAX_GRID_CELLS"),
    ],
)
def test_bad_sizes_exit_2_quickly(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["schedule", "show", "--schedule", "1f1b", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_largest_allowed_size_is_built() -> None:
    from pipeswap.commands.schedule import MAX_SCHEDULE_ACTIONS, estimated_actions
    from pipeswap.schedule.timetable import build_schedule

    # The estimate is an upper bound, so the refusal never turns away a schedule that fits.
    for name, stages, steps, micro in (
        ("gpipe", 3, 5, 4),
        ("1f1b", 4, 2, 7),
        ("async-1f1b", 5, 9, 1),
    ):
        schedule = build_schedule(name, stages, steps, micro)
        assert sum(map(len, schedule.actions)) <= estimated_actions(stages, steps, micro)
    assert estimated_actions(100, 28, 100) <= MAX_SCHEDULE_ACTIONS
