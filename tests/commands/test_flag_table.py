"""Every flag of every command is a config field's: a flag two commands take is one field.

Walks the parsers pipeswap.cli builds (subcommands of subcommands too): each option is made
by pipeswap.commands.options.add_options from a config field, and a flag name declared by
several commands is the same field in each, so its name, type, choices and check are
declared once.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import pytest

from pipeswap.cli import build_parser, main
from pipeswap.commands.options import FIELD_OF, REMOVED

Declaration = tuple[str, argparse.Action]


def _declarations() -> dict[str, list[Declaration]]:
    """Each flag name, with the (command, argument) pairs that declare it."""
    found: dict[str, list[Declaration]] = defaultdict(list)

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{command} {name}".strip())
            elif not isinstance(action, argparse._HelpAction):
                for flag in action.option_strings:
                    found[flag].append((command, action))

    walk(build_parser(), "")
    return found


def _field(action: argparse.Action) -> tuple[type, str] | None:
    field: tuple[type, str] | None = getattr(action, FIELD_OF, None)
    return field


def test_every_flag_is_made_from_a_config_field() -> None:
    hand_written = sorted(
        f"{command} {flag}"
        for flag, declared in _declarations().items()
        for command, action in declared
        if _field(action) is None
    )
    assert hand_written == []


def test_no_flag_is_declared_twice_except_through_one_shared_field() -> None:
    declarations = _declarations()
    assert len(declarations) > 60  # the walk reached every command
    for flag, declared in declarations.items():
        fields = {_field(action) for _, action in declared}
        commands = [command for command, _ in declared]
        assert len(fields) == 1, f"{flag} is declared by {fields} in {commands}"
        assert len(set(commands)) == len(commands), f"{flag} twice in one command: {commands}"
        config, name = next(iter(fields))  # type: ignore[misc]
        assert {action.dest for _, action in declared} == {name}, flag


def test_a_shared_flag_keeps_one_type_and_one_set_of_choices() -> None:
    for flag, declared in _declarations().items():
        kinds = {(type(a), a.type, tuple(a.choices or ()), a.nargs) for _, a in declared}
        assert len(kinds) == 1, f"{flag}: {kinds}"


def test_profile_takes_trains_precision_and_no_dtype() -> None:
    declared = _declarations()
    assert "--dtype" not in declared
    profile_precision = [a for c, a in declared["--precision"] if c == "profile"]
    train_precision = [a for c, a in declared["--precision"] if c == "train"]
    assert _field(profile_precision[0]) == _field(train_precision[0])


@pytest.mark.parametrize("form", [["--dtype", "bfloat16"], ["--dtype=bfloat16"]])
def test_a_removed_flag_names_the_one_to_write(
    form: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile", "--model", "gpt2-micro", "--estimate", "--out", "p.json", *form]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeswap profile: error: --dtype is gone: write --precision")
    assert REMOVED[("profile", "--dtype")] in err


@pytest.mark.parametrize(
    "flag,hint",
    [
        (["--stages", "2"], "--stages is --pipeline K in train"),
        (["--json"], "train prints no JSON: --report FILE"),
        (["--footprint-ration", "1.5"], "did you mean --footprint-ratio?"),
    ],
)
def test_a_flag_of_another_command_or_a_near_miss_names_the_one_to_write(
    flag: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--model", "gpt2-micro", *flag])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeswap train: error: ") and hint in err


def test_an_unknown_flag_is_still_refused_as_argparse_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["simulate", "--graph", "g.json", "--topology", "switch-4", "--bogus"])
    assert stopped.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_train_has_no_flag_that_only_refuses() -> None:
    assert "--error-feedback" not in _declarations()


def test_estimate_is_one_field_in_plan_and_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # plan's `--estimate MODEL` and profile's `--model MODEL --estimate` are one setting:
    # each command takes both forms.
    plan = ["plan", "--topology", "switch-4", "--policy", "disjoint", "--json"]
    assert main([*plan, "--estimate", "gpt2-micro"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert main([*plan, "--model", "gpt2-micro", "--estimate"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert named.pop("solve_s") >= 0 and same.pop("solve_s") >= 0  # wall-clock time
    assert same == named
    assert main([*plan, "--estimate"]) == 2
    assert "--estimate needs the model: write --estimate MODEL" in capsys.readouterr().err
    out = str(tmp_path / "p.json")
    profile = ["profile", "--model", "gpt2-micro", "--out", out, "--json"]
    assert main([*profile, "--estimate", "gpt2-micro"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "estimate"
    assert main([*profile, "--estimate", "gpt2-tiny"]) == 2
    assert "write --model gpt2-micro --estimate" in capsys.readouterr().err


def test_topology_detect_means_this_machine_in_every_command_that_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeswap.hardware import detect
    from pipeswap.hardware.presets import resolve_topology

    graph = tmp_path / "g.json"
    graph.write_text(
        json.dumps(
            {
                "format": "pipeswap.graph/1",
                "tasks": [{"id": "f0", "kind": "compute", "gpu": "gpu0", "duration_s": 1.0}],
            }
        )
    )
    simulate = ["simulate", "--graph", str(graph), "--topology", "detect"]
    monkeypatch.setattr(detect, "detect_topology", lambda **kwargs: None)
    assert main(simulate) == 2
    assert "--topology detect found no NVIDIA GPU here" in capsys.readouterr().err
    monkeypatch.setattr(detect, "detect_topology", lambda **kwargs: resolve_topology("switch-4"))
    assert main(simulate) == 0
    assert capsys.readouterr().out.startswith("topology switch-4, 1 tasks")
    plan = ["plan", "--estimate", "gpt2-micro", "--topology", "detect", "--policy", "none"]
    assert main(plan) == 0
