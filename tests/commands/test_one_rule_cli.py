"""One rule over every command: stdout carries only what the command promises (its table
or its JSON); a failure is one line on stderr, exit 2 for bad input and 1 for a crash,
with no traceback unless PIPESWAP_DEBUG=1.

Covers: pipeswap/cli.py and every module of pipeswap/commands/.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeswap import cli
from pipeswap.cli import main

GRAPH = {
    "format": "pipeswap.graph/1",
    "tasks": [{"id": "f", "kind": "compute", "gpu": "gpu0", "duration_s": 1.0}],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("inputs")
    profile = folder / "profile.json"
    argv = ["profile", "--model", "gpt2-tiny"]  # saves enough to swap at 1.5x
    assert main([*argv, "--estimate", "--gpu", "v100-32gb", "--out", str(profile)]) == 0
    graph = folder / "graph.json"
    graph.write_text(json.dumps(GRAPH))
    bad = folder / "bad.json"
    bad.write_text("{not json")
    return {"profile": str(profile), "graph": str(graph), "bad": str(bad)}


# For every command: argv that is bad input (exit 2), with the placeholders of `files`.
BAD_INPUT = {
    "env": ["env", "--json", "--no-such-flag"],
    "profile": [
        "profile",
        "--model",
        "gpt2-micro",
        "--batch",
        "0",
        "--estimate",
        "--out",
        "p.json",
    ],
    "topology": ["topology", "show", "no-such-server"],
    "plan": ["plan", "--profile", "{bad}", "--topology", "switch-4"],
    "simulate": ["simulate", "--graph", "{graph}", "--topology", "no-such-server"],
    "schedule": ["schedule", "show", "--schedule", "1f1b", "--stages", "0", "--steps", "2"],
    "train": ["train", "--model", "gpt2-micro", "--steps", "0"],
    "export": ["export", "{profile}", "--out", "x"],
    "demo": ["demo", "--out", "{profile}/inside-a-file"],
}

# For every command that promises JSON: argv whose whole stdout must parse.
JSON_OUTPUT = {
    "env": ["env", "--json"],
    "topology": ["topology", "show", "switch-4", "--json"],
    "plan": ["plan", "--profile", "{profile}", "--topology", "switch-4", "--compare", "--json"],
    "plan mip": [
        "plan",
        "--profile",
        "{profile}",
        "--topology",
        "switch-4",
        "--swap-policy",
        "mip",
        "--footprint-ratio",
        "1.5",
        "--time-limit",
        "5",
        "--json",
    ],
    "plan auto": [
        "plan",
        "--profile",
        "{profile}",
        "--topology",
        "switch-4",
        "--swap-policy",
        "auto",
        "--footprint-ratio",
        "1.5",
        "--time-limit",
        "5",
        "--json",
    ],
    "simulate": ["simulate", "--graph", "{graph}", "--topology", "switch-4", "--json"],
    "schedule": [
        "schedule",
        "show",
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--steps",
        "2",
        "--json",
    ],
}


# For every command: argv that parses (the crash test replaces the command's run).
RUNS = {
    "env": ["env"],
    "profile": ["profile", "--model", "gpt2-micro", "--estimate", "--out", "p.json"],
    "topology": ["topology", "list"],
    "plan": ["plan", "--profile", "{profile}", "--topology", "switch-4", "--compare"],
    "simulate": ["simulate", "--graph", "{graph}", "--topology", "switch-4"],
    "schedule": ["schedule", "show", "--schedule", "1f1b", "--stages", "2", "--steps", "2"],
    "train": ["train", "--model", "gpt2-micro"],
    "export": ["export", "ckpt", "--out", "x"],
    "demo": ["demo"],
}


def _argv(template: list[str], files: dict[str, str]) -> list[str]:
    return [part.format(**files) for part in template]


def test_every_command_has_a_case() -> None:
    commands = {module.__name__.rsplit(".", 1)[1] for module in cli._COMMANDS}
    assert set(BAD_INPUT) == set(RUNS) == commands


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    # `pipeswap topology list | head -0`: stdout's reader is gone before the first write.
    done = subprocess.Popen(
        [sys.executable, "-m", "pipeswap", "topology", "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert done.stdout is not None and done.stderr is not None
    done.stdout.close()
    err = done.stderr.read().decode()
    assert done.wait(timeout=60) == 1
    assert err == ""  # before: "stopped: this rank lost its peers" (a BrokenPipeError)


@pytest.mark.parametrize("command", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(
    command: str, files: dict[str, str], capfd: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(_argv(BAD_INPUT[command], files))
    except SystemExit as exc:  # argparse's own refusal (an unknown flag): usage, then one line
        code = int(exc.code or 0)
    out, err = capfd.readouterr()
    assert code == 2 and out == ""
    assert "Traceback" not in err
    if command == "env":  # argparse's own refusal: its usage, then one line
        assert err.splitlines()[-1] == "pipeswap: error: unrecognized arguments: --no-such-flag"
    else:
        assert err.startswith(f"pipeswap {command}: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("command", sorted(JSON_OUTPUT))
def test_json_output_is_only_json(
    command: str, files: dict[str, str], capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(JSON_OUTPUT[command], files)) == 0
    out, err = capfd.readouterr()
    json.loads(out)  # nothing before or after it: no banner, no progress bar
    assert "Traceback" not in err


@pytest.mark.parametrize("command", sorted(BAD_INPUT))
def test_a_crash_in_any_command_is_one_line_and_exit_1(
    command: str,
    files: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    def crash(args: object) -> int:
        raise ZeroDivisionError("division by zero\nsecond line")

    module = __import__(f"pipeswap.commands.{command}", fromlist=["run"])
    monkeypatch.setattr(module, "run", crash)
    monkeypatch.delenv("PIPESWAP_DEBUG", raising=False)
    assert main(_argv(RUNS[command], files)) == 1
    out, err = capfd.readouterr()
    assert out == ""
    assert err == (
        f"pipeswap {command}: crashed: ZeroDivisionError: division by zero "
        "(set PIPESWAP_DEBUG=1 for the traceback)\n"
    )
