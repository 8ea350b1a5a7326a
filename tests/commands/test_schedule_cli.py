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
