"""Tests of `pipeswap demo` (pipeswap.commands.demo).

Covers: pipeswap/commands/demo.py.
"""

from pathlib import Path

from pipeswap.cli import build_parser
from pipeswap.commands.demo import demo_commands


def test_every_demo_step_is_a_valid_command(tmp_path: Path) -> None:
    parser = build_parser()
    (tmp_path / "plan.json").write_text('{"gpus": [{"budget_bytes": 1000}]}')
    for _title, step in demo_commands(tmp_path):
        argv = step() if callable(step) else step
        args = parser.parse_args(argv)  # a typo in the demo fails here, not in front of a user
        assert args.command == argv[0]
