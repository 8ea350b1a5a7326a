"""pipeswap/config_fields.py: fields declared once, errors that name fields, trees replaced by name."""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from pipeswap.config_fields import (
    ConfigError,
    leaf_fields,
    nested_config,
    replace_fields,
    require,
    value_type,
)
from pipeswap.errors import PipeswapError
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig


def test_a_config_error_names_fields_for_python_and_renders_them_for_the_cli() -> None:
    error = ConfigError("{footprint_ratio} is 0.5; give {gpu_memory_bytes} or it, not {x y}")
    assert isinstance(error, PipeswapError)
    assert str(error) == "footprint_ratio is 0.5; give gpu_memory_bytes or it, not {x y}"
    flags = error.render(lambda name: "--" + name.replace("_", "-"))
    assert flags == "--footprint-ratio is 0.5; give --gpu-memory-bytes or it, not {x y}"
    with pytest.raises(ConfigError, match="^lr is 0$"):
        require(False, "{lr} is 0")
    require(True, "never raised")


def test_field_names_are_unique_across_the_whole_tree() -> None:
    # Messages, the CLI's flag table and replace_fields name a field by its name alone.
    names: Counter[str] = Counter()
    stack: list[type] = [TrainConfig]
    while stack:
        config = stack.pop()
        for f in dataclasses.fields(config):
            names[f.name] += 1
            child = nested_config(config, f.name)
            if child is not None:
                stack.append(child)
    assert [name for name, count in names.items() if count > 1] == []
    assert {"optim", "swap", "pipeline", "checkpoint", "policy", "stages"} <= set(names)


def test_leaf_fields_walk_every_component() -> None:
    owners = {owner.__name__ for owner, _ in leaf_fields(TrainConfig)}
    assert owners == {
        "TrainConfig",
        "OptimizerConfig",
        "SwapConfig",
        "PipelineConfig",
        "CheckpointConfig",
        "DataConfig",
        "LogConfig",
    }
    assert all("help" in f.metadata for _, f in leaf_fields(TrainConfig))


def test_replace_fields_reaches_nested_configs_and_checks_them_again() -> None:
    run = TrainConfig("gpt2-micro", pipeline=PipelineConfig(stages=2))
    changed = replace_fields(run, lr=0.1, schedule="gpipe", steps=3)
    assert (changed.optim.lr, changed.require_pipeline().schedule, changed.steps) == (
        0.1,
        "gpipe",
        3,
    )
    assert run.optim.lr is None  # frozen: the original is untouched
    with pytest.raises(ConfigError, match="lr is -1"):
        replace_fields(run, lr=-1.0)
    with pytest.raises(ConfigError, match="no field named policy"):
        replace_fields(run, policy="disjoint")  # swap is None in a pipeline run


def test_value_type_drops_none() -> None:
    assert value_type(int | None) is int
    assert value_type(str) is str


# Parameters named like a setting that are arguments of a model or data call, not the
# setting: which seed or device to build on, which batch or length to run.
_ARGUMENTS = {"seed", "device", "batch", "seq_len", "image_size", "steps", "model"}


def test_every_settings_default_is_declared_once() -> None:
    """No function re-declares a setting's default: one that takes a parameter named like a
    setting either requires it or refers to the config's own default (``SwapConfig.bucket_bytes``)."""
    defaults = {
        f.name: f.default
        for _, f in leaf_fields(TrainConfig)
        if f.default not in (None, dataclasses.MISSING) and f.name not in _ARGUMENTS
    }
    root = Path(__file__).resolve().parents[1] / "pipeswap"
    again = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg not in defaults or not isinstance(default, ast.Constant):
                    continue
                if default.value == defaults[arg.arg]:
                    again.append(
                        f"{path.name}:{node.lineno} {node.name}({arg.arg}={default.value!r})"
                    )
    assert again == []
