"""`pipeswap train --profile`: a profile of another model, batch or shape is refused by name.

Covers: pipeswap/training/data_parallel.py, pipeswap/training/pipeline_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeswap.cli import main
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.profiling.estimate import estimate
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig


def _profile(tmp_path: Path, model: str, batch: int, **shape: int) -> str:
    path = tmp_path / f"{model}-b{batch}-{'-'.join(map(str, shape.values()))}.json"
    estimate(model, batch, optimizer="adamw", **shape).save(path)  # (train's default)
    return str(path)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["train", *argv, "--device", "cpu", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeswap train: error: ") and "Traceback" not in err
    return " ".join(err.split())  # argparse-style wrapping aside


GPT_DP = ["--model", "gpt2-micro", "--batch", "4", "--seq-len", "64"]


def test_data_parallel_refuses_a_profile_of_another_seq_len(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _profile(tmp_path, "gpt2-micro", 4, seq_len=16)
    err = _refused([*GPT_DP, "--profile", path], capsys)
    assert (
        f"{path} profiles seq_len 16 but this run has --seq-len 64; profile this run or drop "
        "--profile" in err
    )


def test_data_parallel_refuses_a_profile_of_another_image_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _profile(tmp_path, "resnet-micro", 4, image_size=32)
    argv = ["--model", "resnet-micro", "--batch", "4", "--image-size", "16", "--profile", path]
    err = _refused(argv, capsys)
    assert f"{path} profiles image_size 32 but this run has --image-size 16" in err


def test_data_parallel_still_refuses_another_model_or_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _profile(tmp_path, "gpt2-micro", 8, seq_len=64)
    assert "profiles (model, batch, dtype) = ('gpt2-micro', 8, 'float32')" in _refused(
        [*GPT_DP, "--profile", path], capsys
    )


def test_data_parallel_trains_with_a_matching_profile(tmp_path: Path) -> None:
    path = _profile(tmp_path, "gpt2-micro", 4, seq_len=64)
    report = tmp_path / "r.json"
    argv = [
        "train",
        *GPT_DP,
        "--device",
        "cpu",
        "--steps",
        "1",
        "--profile",
        path,
        "--report",
        str(report),
    ]
    assert main(argv) == 0
    assert json.loads(report.read_text())["seq_len"] == 64


PIPE = ["--model", "gpt2-micro", "--batch", "4", "--seq-len", "16", "--pipeline", "2", "--emulate"]


@pytest.mark.parametrize(
    "model, batch, seq_len, message",
    [
        (
            "bert-micro",
            4,
            16,
            "{path} profiles bert-micro but this run trains gpt2-micro; "
            "profile this run or drop --profile",
        ),
        (
            "gpt2-micro",
            8,
            16,
            "{path} profiles batch 8 but this run has --batch 4; "
            "profile this run or drop --profile",
        ),
        (
            "gpt2-micro",
            4,
            64,
            "{path} profiles seq_len 64 but this run has --seq-len 16; "
            "profile this run or drop --profile",
        ),
    ],
)
def test_pipeline_refuses_a_profile_of_another_model_batch_or_shape(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: str,
    batch: int,
    seq_len: int,
    message: str,
) -> None:
    path = _profile(tmp_path, model, batch, seq_len=seq_len)
    assert message.format(path=path) in _refused([*PIPE, "--profile", path], capsys)


def test_pipeline_refuses_a_profile_whose_layers_are_named_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(_profile(tmp_path, "gpt2-micro", 4, seq_len=16))
    obj = json.loads(path.read_text())
    obj["layers"][2]["name"] = "mlp1"
    path.write_text(json.dumps(obj))
    err = _refused([*PIPE, "--profile", str(path)], capsys)
    assert (
        f"{path} names layer 2 'mlp1' but gpt2-micro's layer 2 is 'block1': profile the same "
        "model or drop --profile" in err
    )


def test_pipeline_refuses_a_profile_with_another_layer_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _profile(tmp_path, "gpt2-micro", 4, seq_len=16)
    argv = ["--model", "resnet-micro", "--batch", "4", "--pipeline", "2", "--emulate"]
    # The model's name is checked first: a profile of another model says so.
    assert f"{path} profiles gpt2-micro but this run trains resnet-micro" in _refused(
        [*argv, "--profile", path], capsys
    )


def test_pipeline_partitions_with_a_matching_profile(tmp_path: Path) -> None:
    path = _profile(tmp_path, "gpt2-micro", 4, seq_len=16)
    config = TrainConfig(
        "gpt2-micro",
        batch=4,
        seq_len=16,
        device="cpu",
        profile_path=path,
        pipeline=PipelineConfig(stages=2, emulate=True),
    )
    balance = resolve_pipeline(config).require_pipeline().stage_balance
    assert sum(balance) == 4 and len(balance) == 2


def test_data_parallel_refuses_a_profile_of_another_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The profile counts its optimizer's state: a plan from an SGD profile for an AdamW run
    would hold the AdamW moments beyond its budget (14% on a GPT-2)."""
    path = tmp_path / "sgd.json"
    estimate("gpt2-micro", 4, seq_len=64, optimizer="sgd").save(path)
    err = _refused([*GPT_DP, "--optimizer", "adamw", "--profile", str(path)], capsys)
    assert (
        "profiles optimizer sgd, whose state the plan would count, but this run's is adamw" in err
    )
    assert "profile with --optimizer adamw, or drop --profile" in err
