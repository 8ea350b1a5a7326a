"""pipeswap/commands/options.py: the CLI made from the configs, and its one flag table."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pipeswap.cli import build_parser, main
from pipeswap.commands.options import FLAGS, add_options, flag_of, given, message, option_fields
from pipeswap.commands.settings import COMMAND_SETTINGS
from pipeswap.commands.train import config_from_args
from pipeswap.config_fields import ConfigError, leaf_fields, nested_config
from pipeswap.profiling.profile_config import ProfileConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig


def _train_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]


def _all_names() -> set[str]:
    names: set[str] = set()
    stack: list[type] = [TrainConfig, ProfileConfig, *COMMAND_SETTINGS]
    while stack:
        config = stack.pop()
        for f in dataclasses.fields(config):
            names.add(f.name)
            child = nested_config(config, f.name)
            if child is not None:
                stack.append(child)
    return names


def test_every_field_of_the_train_config_is_one_train_flag() -> None:
    parser = _train_parser()
    dests = [a.dest for a in parser._actions if a.dest not in ("help", "report", "trace")]
    assert sorted(dests) == sorted(f.name for _, f in leaf_fields(TrainConfig))
    for _, f in leaf_fields(TrainConfig):
        assert parser._option_string_actions[flag_of(f.name)].dest == f.name


def test_the_flag_table_names_only_fields_that_exist() -> None:
    assert set(FLAGS) <= _all_names()
    assert flag_of("seq_len") == "--seq-len" and flag_of("gpu_memory_bytes") == "--gpu-memory"


def test_defaults_and_parsing_come_from_the_fields() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, SwapConfig)
    args = parser.parse_args(["--gpu-memory", "2GiB"])
    assert given(args, SwapConfig) == {"gpu_memory_bytes": 2 * 2**30}
    config = SwapConfig(**given(args, SwapConfig))
    assert config.time_limit_s == SwapConfig().time_limit_s  # the field's own default
    helps = {a.dest: a.help for a in parser._actions}
    assert "(default 60.0)" in helps["time_limit_s"]
    assert {f.name for f in option_fields(SwapConfig)} <= set(helps)


def test_a_config_error_reads_as_flags_on_the_command_line() -> None:
    error = ConfigError("give {gpu_memory_bytes} or {footprint_ratio}, not both; {stages} 2")
    assert message(error) == "give --gpu-memory or --footprint-ratio, not both; --pipeline 2"
    assert str(error) == "give gpu_memory_bytes or footprint_ratio, not both; stages 2"


def test_train_and_plan_refuse_the_same_value_with_the_same_check(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    args = _train_parser().parse_args(["--model", "gpt2-tiny", "--footprint-ratio", "0.5"])
    with pytest.raises(ConfigError) as refused:
        config_from_args(args)
    assert message(refused.value).startswith("--footprint-ratio is 0.5; use a ratio >= 1")
    code = main(
        [
            "plan",
            "--profile",
            "p.json",
            "--topology",
            "switch-4",
            "--compare",
            "--footprint-ratio",
            "0.5",
        ]
    )
    assert code == 2
    assert "--footprint-ratio is 0.5; use a ratio >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--gpu-memory", "abc", "not a byte size"), ("--bucket-size", "5XB", "unknown unit 'XB'")],
)
def test_a_value_its_parser_refuses_names_its_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    code = main(["train", "--model", "gpt2-micro", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert f"{flag} {value}: {says}" in err[0]
