"""Tests of `pipeswap demo` (pipeswap.commands.demo).

Covers: pipeswap/commands/demo.py.
"""

import json
from pathlib import Path

import pytest

from pipeswap.cli import build_parser, main
from pipeswap.commands.demo import PythonStep, demo_commands, hugging_face_steps


def test_every_demo_step_is_a_valid_command(tmp_path: Path) -> None:
    parser = build_parser()
    (tmp_path / "plan.json").write_text('{"gpus": [{"budget_bytes": 1000}]}')
    for _title, step in demo_commands(tmp_path):
        if isinstance(step, PythonStep):
            continue
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


# Minutes of the fast suite's budget: it runs in `make test-slow`.
@pytest.mark.slow
def test_the_hugging_face_steps_train_save_and_generate(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    printed = []
    for _title, step in hugging_face_steps(tmp_path):
        if isinstance(step, PythonStep):
            printed.append(step.run())
            continue
        assert main(step) == 0
    reports = [json.loads((tmp_path / f"llama-{n}.json").read_text()) for n in ("swap", "pipeline")]
    for report in reports:  # every loss the demo prints falls
        assert report["losses"][-1] < report["losses"][0] - 0.5
        assert report["precision"] == "bf16-mixed"
    assert reports[0]["swapped_bytes"][0] > 0
    assert printed[-1].startswith("'Return the' -> 'Return the")
    assert (tmp_path / "llama-trained" / "model.safetensors").is_file()
