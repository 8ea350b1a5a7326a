"""`pipeswap train`: one option table, one report for every mode, refusals that name the mode.

Covers: pipeswap/commands/train.py, pipeswap/training/config.py, pipeswap/training/data_parallel.py,
pipeswap/training/pipeline_parallel.py, pipeswap/training/report.py, pipeswap/training/run.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeswap.cli import build_parser, main
from pipeswap.commands.train import summary_lines
from pipeswap.errors import PipeswapError
from pipeswap.profiling.measure import measure
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training import data_parallel
from pipeswap.training.data_parallel import default_topology
from pipeswap.training.report import load_report
from pipeswap.training.run import train

COMMON_KEYS = (
    "format",
    "mode",
    "model",
    "steps",
    "losses",
    "params_sha256",
    "batch",
    "seq_len",
    "image_size",
    "seed",
    "optimizer",
    "lr",
    "device",
    "nproc",
    "train_config",
)
DP_KEYS = (
    "losses_per_rank",
    "step_s",
    "peak_resident_bytes",
    "budget_bytes",
    "swapped_bytes",
    "late_fetches",
    "predicted_step_s",
    "measured_step_s",
    "plan",
    "topology",
    "gpus",
)


def _run(tmp_path: Path, name: str, *argv: str) -> dict[str, Any]:
    report = tmp_path / f"{name}.json"
    assert main(["train", *argv, "--device", "cpu", "--report", str(report)]) == 0
    return load_report(report).to_json()  # the file's keys, read back through TrainReport


GPT = ("--model", "gpt2-tiny", "--batch", "4", "--seq-len", "32", "--steps", "3")


def test_single_process_report_has_every_field_and_matches_no_swapping(tmp_path: Path) -> None:
    # SGD's one state buffer: the ratio was set for it (AdamW's two leave less to swap).
    sgd = (*GPT, "--optimizer", "sgd")
    swapped = _run(tmp_path, "swap", *sgd, "--swap-policy", "disjoint", "--footprint-ratio", "1.3")
    plain = _run(tmp_path, "none", *sgd, "--swap-policy", "none", "--footprint-ratio", "1")
    for key in (*COMMON_KEYS, *DP_KEYS):
        assert key in swapped, key
    assert swapped["format"] == "pipeswap.train/2" and swapped["mode"] == "data-parallel"
    assert len(swapped["losses"]) == 3 and swapped["losses_per_rank"] == [swapped["losses"]]
    assert swapped["losses"] == plain["losses"]
    assert swapped["params_sha256"] == plain["params_sha256"]
    assert swapped["swapped_bytes"][0] > 0 == plain["swapped_bytes"][0]
    # The device's own meter (the live storages on the CPU) within the budget.
    assert swapped["peak_resident_bytes"][0] <= swapped["budget_bytes"] * 1.02
    assert swapped["peak_resident_bytes"][0] < plain["peak_resident_bytes"][0]
    assert swapped["topology"] == "switch-4" and swapped["gpus"] == ["gpu0"]
    assert swapped["predicted_step_s"] > 0 and swapped["measured_step_s"] > 0
    # A preset is no measurement of this machine: its step time is no prediction here.
    assert swapped["calibrated"] is False and swapped["stopped_by"] is None


def test_no_prediction_is_printed_without_a_calibration(tmp_path: Path) -> None:
    # Before: "738.5 ms measured, 31.5 ms predicted (-96% off)" on a newcomer's first run.
    report = tmp_path / "r.json"
    argv = ["train", *GPT, "--steps", "2", "--device", "cpu", "--swap-policy", "none"]
    assert main([*argv, "--report", str(report)]) == 0
    uncalibrated = load_report(report)
    assert uncalibrated.calibrated is False
    line = summary_lines(uncalibrated)[0]
    assert "ms measured, uncalibrated, so no prediction" in line and "predicted" not in line
    assert "pipeswap topology calibrate --nproc 1 --device cpu" in line
    # The device's own meter beside the budget, and by how much a rank went over it.
    assert "/GPU (measured peak " in line and "over it" not in line
    peak = max(uncalibrated.data_parallel.peak_resident_bytes)  # type: ignore[union-attr]
    over = replace(uncalibrated.data_parallel, budget_bytes=peak - 99)  # type: ignore[type-var]
    assert "99 B over it)" in summary_lines(replace(uncalibrated, data_parallel=over))[0]
    calibrated = summary_lines(replace(uncalibrated, calibrated=True))[0]
    assert "ms predicted (" in calibrated and "% off)" in calibrated


def test_no_swapping_under_a_budget_too_small_says_by_how_much(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", *GPT, "--device", "cpu", "--swap-policy", "none", "--footprint-ratio", "1.5"]
    assert main(argv) == 2
    assert "cannot keep its budget" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "gpt2-tiniest"], "gpt2-tiny"),
        ([*GPT, "--accumulate", "0"], "--accumulate is 0"),
        ([*GPT, "--batch", "0"], "--batch is 0"),
        ([*GPT, "--lr", "nan"], "--lr is nan"),
        ([*GPT, "--momentum", "-3"], "--momentum is -3"),
        ([*GPT, "--nproc", "0"], "--nproc is 0"),
        ([*GPT, "--timeout", "0"], "--timeout is 0"),
        ([*GPT, "--schedule", "gpipe"], "--schedule applies to pipeline training"),
        ([*GPT, "--emulate"], "--emulate applies to pipeline training"),
        ([*GPT, "--balance", "1,1"], "--balance applies to pipeline training"),
        ([*GPT, "--pipeline", "2", "--time-limit", "5"], "--time-limit applies to data-parallel"),
        ([*GPT, "--pipeline", "2", "--emulate", "--nproc", "2"], "drop --nproc"),
        ([*GPT, "--footprint-ratio", "0.5"], "--footprint-ratio is 0.5"),
        ([*GPT, "--seed", str(2**64)], "--seed is 18446744073709551616"),
        ([*GPT, "--lr", "inf"], "--lr is inf"),
        ([*GPT, "--lr", "-1"], "--lr is -1"),
        ([*GPT, "--weight-decay", "nan"], "--weight-decay is nan"),
        ([*GPT, "--timeout", "-1"], "--timeout is -1"),
        ([*GPT, "--timeout", "nan"], "--timeout is nan"),
        (["--model", "gpt2-tiny", "--seq-len", "0"], "--seq-len is 0"),
        (["--model", "gpt2-tiny", "--seq-len", "-4"], "--seq-len is -4"),
        (["--model", "resnet-micro", "--image-size", "0"], "--image-size is 0"),
        ([*GPT, "--pipeline", "2", "--emulate", "--eval-batches", "-1"], "--eval-batches is -1"),
        ([*GPT, "--pipeline", "-2", "--emulate"], "--pipeline is -2"),
        ([*GPT, "--gpu-memory", "1e300GiB"], "larger than 2**63 - 1 bytes"),
        ([*GPT, "--pipeline", "2", "--emulate", "--micro-batches", "0"], "--micro-batches is 0"),
        ([*GPT, "--pipeline", "2", "--emulate", "--lr-warmup", "-1"], "--lr-warmup must be 0"),
        ([*GPT, "--pipeline", "0", "--emulate"], "--pipeline is 0"),
        (
            ["--model", "gpt2-micro", "--batch", "4", "--pipeline", "50", "--emulate"],
            "fewer than the 50 stages",
        ),
        (
            ["--model", "gpt2-micro", "--batch", "4", "--pipeline", "3", "--emulate"],
            "pass --micro-batches M",
        ),
        (
            ["--model", "json:dumps", "--seq-len", "8", "--pipeline", "2", "--emulate"],
            "calling dumps() failed",
        ),
        (["--model", "json:loads", "--seq-len", "8"], "calling loads() failed"),
    ],
)
def test_bad_values_and_options_of_the_other_mode_exit_2_naming_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_unwritable_report_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    cases = [
        (["--report", str(tmp_path)], "is a directory"),
        (["--report", str(profile / "r.json")], "is a file, not a folder"),
        (["--report", str(profile), "--profile", str(profile)], "is also an input"),
        (
            [
                "--pipeline",
                "2",
                "--emulate",
                "--report",
                str(tmp_path / "a.json"),
                "--trace",
                str(tmp_path / "a.json"),
            ],
            "two outputs",
        ),
    ]
    for extra, message in cases:
        assert main(["train", *GPT, "--steps", "100000", "--device", "cpu", *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert profile.read_text() == "{}"


def test_help_groups_every_option_under_the_mode_it_belongs_to() -> None:
    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    titles = {
        group.title: {a.option_strings[0] for a in group._group_actions}
        for group in train_parser._action_groups
    }
    pipeline = titles["pipeline parallelism (--pipeline K)"]
    swapping = titles["swapping (data parallelism; a pipeline's stages: the first three)"]
    assert {"--schedule", "--weights", "--emulate", "--balance"} <= pipeline
    assert {"--swap-policy", "--footprint-ratio"} <= swapping
    shared = titles["where and how long"] | titles["what to train"]
    # Both modes plan or predict on a machine: --topology belongs to neither alone.
    assert {"--nproc", "--device", "--profile", "--timeout", "--topology"} <= shared


def test_default_topology_on_cpu_is_a_preset_with_enough_gpus() -> None:
    assert default_topology("cpu", 2).name == "switch-4"
    assert len(default_topology("cpu", 6).gpus) == 8
    with pytest.raises(PipeswapError, match="topology FILE"):
        default_topology("cpu", 9)


def test_data_parallel_and_a_one_micro_batch_gpipe_train_alike() -> None:
    """The same synchronous training in two modes: the same losses, one digest definition."""
    base = TrainConfig("resnet-micro", batch=4, steps=3, device="cpu", progress=False)
    dp = train(replace(base, swap=SwapConfig(policy="none")))
    pipe = PipelineConfig(stages=2, schedule="gpipe", micro_batches=1, emulate=True)
    gpipe = train(replace(base, pipeline=pipe))
    assert dp is not None and gpipe is not None
    a, b = dp.report.to_json(), gpipe.report.to_json()
    assert (a["mode"], b["mode"]) == ("data-parallel", "emulate")
    assert all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a["losses"], b["losses"]))
    assert len(a["losses"]) == len(b["losses"]) == 3
    assert {
        k: a[k]
        for k in COMMON_KEYS
        if k not in ("mode", "nproc", "train_config", "losses", "params_sha256")
    } == {
        k: b[k]
        for k in COMMON_KEYS
        if k not in ("mode", "nproc", "train_config", "losses", "params_sha256")
    }


def test_old_reports_are_refused_with_what_to_do(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "pipeswap.swaptrain/1", "losses": [[1.0]]}))
    with pytest.raises(PipeswapError, match="old format.*pipeswap.train/2"):
        load_report(old)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "pipeswap.profile/1"}))
    with pytest.raises(PipeswapError, match="not a pipeswap training report"):
        load_report(other)


@pytest.mark.dist
def test_the_issue_command_on_two_ranks(tmp_path: Path) -> None:
    command = (
        "--model",
        "gpt2-tiny",
        "--batch",
        "8",
        "--seq-len",
        "64",
        "--steps",
        "5",
        "--nproc",
        "2",
        "--eval-batches",
        "3",
    )
    swapped = _run(
        tmp_path, "swap", *command, "--swap-policy", "disjoint", "--footprint-ratio", "1.3"
    )
    plain = _run(tmp_path, "none", *command, "--swap-policy", "none", "--footprint-ratio", "1")
    for key in (*COMMON_KEYS, *DP_KEYS):
        assert key in swapped, key
    assert len(swapped["losses"]) == 5 and swapped["nproc"] == 2
    assert len(swapped["losses_per_rank"]) == 2 and all(len(r) == 5 for r in swapped["step_s"])
    assert swapped["losses"] == plain["losses"]
    assert swapped["losses_per_rank"] == plain["losses_per_rank"]
    assert swapped["params_sha256"] == plain["params_sha256"]
    assert len(set(swapped["params_sha256_per_rank"])) == 1
    assert swapped["gpus"] == ["gpu0", "gpu1"]
    assert all(b > 0 for b in swapped["swapped_bytes"])
    peaks, budget = swapped["peak_resident_bytes"], swapped["budget_bytes"]
    assert all(peak <= budget * 1.02 for peak in peaks), (peaks, budget)
    # Each rank scored its own 3 held-out batches: the report counts the 6 (it said 3).
    assert swapped["eval"]["batches"] == 6 and swapped["eval"]["loss"] > 0


@pytest.mark.dist
def test_a_refusal_found_on_the_ranks_is_printed_once_in_flags(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # Before: three times (each rank naming gpu_memory_bytes, then the launcher --gpu-memory).
    argv = ["train", *GPT, "--device", "cpu", "--nproc", "2", "--swap-policy", "none"]
    assert main([*argv, "--footprint-ratio", "1.5"]) == 2  # found as the ranks prepare
    err = capfd.readouterr().err
    assert err.count("cannot keep its budget") == 1 and len(err.splitlines()) == 1, err
    assert "--gpu-memory" in err and "gpu_memory_bytes" not in err


def test_a_cuda_rank_binds_its_gpu_before_the_first_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL runs the plan's broadcast on the current device: it must be the rank's own."""
    log: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(("bind", device)))

    def plan(config: Any, world_size: int, device: torch.device) -> dict[str, Any]:
        log.append(("plan", device))
        raise PipeswapError("stop after planning")

    monkeypatch.setattr(data_parallel, "_plan", plan)
    config = TrainConfig(
        "gpt2-tiny", batch=2, seq_len=8, steps=1, device="cpu", swap=SwapConfig(policy="none")
    )
    cuda = replace(config.resolved(), device="cuda")  # ranks get a resolved config
    with pytest.raises(PipeswapError, match="stop after planning"):
        data_parallel.data_parallel_rank(0, 1, cuda, local_rank=1)
    gpu = torch.device("cuda", 1)
    assert log == [("bind", gpu), ("plan", gpu)]


def test_recompute_save_on_cpu_and_hybrid_policies_train_like_no_swapping(tmp_path: Path) -> None:
    # Links slow enough that moving a byte costs more than recomputing it: hybrid recomputes.
    topology = tmp_path / "slow.json"
    topology.write_text(
        json.dumps(
            {
                "format": "pipeswap.topology/1",
                "name": "slow-links",
                "nodes": [
                    {"id": "cpu0", "kind": "cpu"},
                    {"id": "sw0", "kind": "switch"},
                    {"id": "gpu0", "kind": "gpu", "copy_engines": 2, "memory_bytes": 2**35},
                ],
                "links": [
                    {"a": "gpu0", "b": "sw0", "gb_per_s": 0.05},
                    {"a": "sw0", "b": "cpu0", "gb_per_s": 0.05},
                ],
            }
        )
    )
    # ResNet: BatchNorm statistics must not be updated twice by a recomputed block. One
    # profile for every run (measuring is most of a run's time here).
    profile = tmp_path / "profile.json"
    measure("resnet-micro", 4, image_size=32, warmup=0, repeats=1).save(profile)
    common = (
        "--model",
        "resnet-micro",
        "--batch",
        "4",
        "--image-size",
        "32",
        "--steps",
        "2",
        "--topology",
        str(topology),
        "--profile",
        str(profile),
    )
    plain = _run(tmp_path, "none", *common, "--swap-policy", "none", "--footprint-ratio", "1")
    for policy, ratio in (("recompute", "1"), ("save-on-cpu", "1"), ("hybrid", "1.3")):
        report = _run(
            tmp_path, policy, *common, "--swap-policy", policy, "--footprint-ratio", ratio
        )
        assert report["policy"] == policy
        assert report["losses"] == plain["losses"], policy
        assert report["params_sha256"] == plain["params_sha256"], policy
        assert report["buffers_sha256"] == plain["buffers_sha256"], policy
        gpu = report["plan"]["gpus"][0]
        assert report["recompute"] == [gpu["recompute"]]
        assert report["recomputed_layers"] == [len(gpu["recompute"])]
        assert (report["recomputed_bytes"][0] > 0) == bool(gpu["recompute"])
        assert report["swapped_bytes"] == [gpu["swapped_bytes"]]
        assert report["peak_resident_bytes"][0] <= report["budget_bytes"] * 1.02
        assert report["peak_resident_bytes"][0] < plain["peak_resident_bytes"][0], policy
        if policy == "recompute":
            assert gpu["recompute"] and not gpu["swaps"]
        elif policy == "save-on-cpu":
            assert gpu["swaps"] and not gpu["recompute"]
        else:
            assert gpu["recompute"] or gpu["swaps"]


@pytest.mark.parametrize(
    "mode", [[], ["--nproc", "2"], ["--pipeline", "2", "--emulate"], ["--pipeline", "2"]]
)
def test_a_diverging_run_exits_2_in_every_mode(mode: list[str], capsys: Any) -> None:
    # Before: losses [5.42, 9.3e8, nan] and exit 0 (with SGD, then every model's default).
    argv = ["--model", "gpt2-micro", "--optimizer", "sgd", "--lr", "1e5", "--steps", "5", *mode]
    assert main(["train", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the loss is nan at mini-batch 2" in err and "training diverged" in err
    assert "lower --lr" in err and "Traceback" not in err


@pytest.mark.parametrize("mode", [[], ["--pipeline", "2", "--emulate"]])
def test_nan_weights_stop_at_once_unless_asked_to_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: list[str], capsys: Any
) -> None:
    # Before: losses [nan, nan, ...] and exit 0.
    (tmp_path / "nan_models.py").write_text(
        "import torch\n"
        "def build():\n"
        "    m = torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Linear(8, 300))\n"
        "    with torch.no_grad():\n"
        "        m[1].weight[0, 0] = float('nan')\n"
        "    return m\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["train", "--model", "nan_models:build", "--seq-len", "8", "--steps", "3", *mode]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the loss is nan at mini-batch 0 (" in err and "before any update" in err
    assert main([*argv, "--device", "cpu", "--keep-nonfinite"]) == 0


def test_a_run_stopped_before_any_step_says_nothing_was_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal while the run starts: one line saying so, 128 + the signal."""
    import pipeswap.commands.train as command

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "train", interrupted)
    code = main(["train", "--model", "gpt2-micro", "--steps", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert err == ["pipeswap train: stopped by SIGINT: no report or checkpoint was written"]
