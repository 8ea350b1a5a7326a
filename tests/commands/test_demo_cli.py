"""Tests of `pipeswap demo` (pipeswap.commands.demo).

Covers: pipeswap/commands/demo.py.
"""

import json
from pathlib import Path

from pipeswap.cli import build_parser, main
from pipeswap.commands.demo import demo_commands


def test_every_demo_step_is_a_valid_command(tmp_path: Path) -> None:
    parser = build_parser()
    (tmp_path / "plan.json").write_text('{"gpus": [{"budget_bytes": 1000}]}')
    for _title, step in demo_commands(tmp_path):
        argv = step() if callable(step) else step
        args = parser.parse_args(argv)  # a typo in the demo fails here, not in front of a user
        assert args.command == argv[0]


def test_the_demo_pipeline_trains_rather_than_diverges(tmp_path: Path) -> None:
    # Before: SGD at 0.05 with spectrain printed "loss 5.3943 -> 11.1243" (5.4, 4.6, 8.0, ...).
    emulated = [
        step
        for title, step in demo_commands(tmp_path)
        if isinstance(step, list) and "--emulate" in step
    ]
    assert len(emulated) == 1
    argv = emulated[0]
    report = tmp_path / "pipeline-emulated.json"
    argv = [*argv[: argv.index("--report")], "--report", str(report)]
    assert main(argv) == 0
    losses = json.loads(report.read_text())["losses"]
    assert losses[-1] < losses[0] - 1.0  # 5.39 -> 4.09 when this was written
    assert max(losses) <= losses[0] + 0.01  # never above where it started
