"""`pipeswap train --pipeline K`: report keys, runtime == emulator, errors that name the fix.

Covers: pipeswap/commands/train.py, pipeswap/training/pipeline_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeswap.cli import main

BASE = ["train", "--model", "gpt2-micro", "--seq-len", "16", "--batch", "4", "--steps", "3"]


def test_a_data_parallel_swap_option_with_pipeline_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*BASE, "--pipeline", "2", "--emulate", "--bucket-size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "--bucket-size applies to data-parallel training" in err and "--swap-policy" in err


def test_emulate_report_has_every_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    argv = [
        *BASE,
        "--pipeline",
        "2",
        "--schedule",
        "async-1f1b",
        "--weights",
        "spectrain",
        "--emulate",
        "--report",
        str(report),
    ]
    assert main(argv) == 0
    obj = json.loads(report.read_text())
    for key in (
        "losses",
        "eval",
        "samples_per_s",
        "stage_busy",
        "params_sha256",
        "prediction_error",
    ):
        assert key in obj
    assert len(obj["losses"]) == 3 and len(obj["stage_busy"]) == 2
    assert obj["eval"]["loss"] > 0
    assert obj["prediction_error"][0]["forward"] is not None
    assert obj["prediction_error"][1] == {"stage": 1, "forward": None, "backward": None}
    assert obj["params_sha256"] in capsys.readouterr().out


@pytest.mark.dist
def test_nproc_and_emulate_give_the_same_sha256(tmp_path: Path) -> None:
    common = [
        *BASE,
        "--pipeline",
        "2",
        "--schedule",
        "async-1f1b",
        "--weights",
        "stash",
        "--balance",
        "1,3",
    ]
    assert main([*common, "--nproc", "2", "--report", str(tmp_path / "rt.json")]) == 0
    assert main([*common, "--emulate", "--report", str(tmp_path / "em.json")]) == 0
    runtime = json.loads((tmp_path / "rt.json").read_text())
    emulated = json.loads((tmp_path / "em.json").read_text())
    assert runtime["params_sha256"] == emulated["params_sha256"]
    assert runtime["losses"] == emulated["losses"]
    assert runtime["config"]["balance"] == [1, 3]
    assert "prediction_error" not in runtime
    # The processes' run states the simulator's step beside its own (the emulator none).
    assert runtime["predicted_step_s"] > 0 and emulated.get("predicted_step_s") is None
    assert runtime["measured_step_s"] == pytest.approx(runtime["wall_s"] / 3)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--pipeline", "2", "--nproc", "3"], "--nproc 3 does not match --pipeline 2"),
        (["--pipeline", "5", "--schedule", "async-1f1b"], "fewer than the 5 stages"),
        (["--pipeline", "2", "--balance", "1,2"], "add up to the model's 4 layers"),
        (
            [
                "--pipeline",
                "2",
                "--schedule",
                "async-1f1b",
                "--weights",
                "spectrain",
                "--optimizer",
                "adam",
            ],
            "--weights predict-adam",
        ),
        (["--pipeline", "2", "--micro-batches", "3"], "equal parts"),
        (["--pipeline", "2", "--memory-cap", "1GiB"], "needs --profile"),
    ],
)
def test_errors_exit_2_and_name_the_fix(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BASE, *extra, "--emulate"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("mode", [["--emulate"], []])
def test_a_wrong_image_size_is_refused_in_pipelines_as_in_data_parallel(
    tmp_path: Path, mode: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from tests.models.hf_configs import save_config

    vit = save_config(tmp_path / "vit", "vit")  # 32x32 images
    for extra in (["--pipeline", "2", *mode], []):
        argv = ["train", "--model", vit, "--image-size", "40", "--steps", "2", *extra]
        assert main(argv) == 2  # before: a ValueError traceback from transformers, exit 1
        err = capsys.readouterr().err
        assert err.endswith("takes 32x32 images (its config's image_size); pass --image-size 32\n")


def test_a_pipeline_whose_stages_swap_prints_each_stages_plan_and_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "r.json"
    argv = ["train", "--model", "gpt2-tiny", "--seq-len", "32", "--batch", "16", "--steps", "2"]
    argv += ["--pipeline", "4", "--micro-batches", "8", "--emulate", "--balance", "2,1,1,2"]
    argv += ["--optimizer", "sgd"]  # the ratio was set for SGD's one state buffer
    assert main([*argv, "--swap-policy", "disjoint", "--footprint-ratio", "1.25"]) == 0
    out = capsys.readouterr().out
    assert "stages swap (disjoint, budget" in out
    assert "rank 0 (stage 0): swaps embed" in out and "recomputes -" in out
    plain_sha = out.split("params sha256 ")[1].split()[0]
    assert main([*argv, "--swap-policy", "none", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "stages swap" not in out and f"params sha256 {plain_sha}" in out
    assert "stage_swap" not in json.loads(report.read_text())
    # A budget below what any plan fits: exit 2, naming the smallest that works.
    assert main([*argv, "--swap-policy", "disjoint", "--gpu-memory", "1KiB"]) == 2
    assert "the smallest budget that works is" in capsys.readouterr().err
