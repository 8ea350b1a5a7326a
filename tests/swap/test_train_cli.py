"""`pipeswap train` for data-parallel swapping: the report, transparency, errors, options.

Covers: pipeswap/swap/train_cli.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.swap import train_cli
from pipeswap.swap.dp import TrainSettings, ZooJob
from pipeswap.swap.train_cli import add_swap_train_arguments, default_topology, run_data_parallel

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

REPORT_KEYS = (
    "losses", "step_s", "params_sha256", "peak_resident_bytes", "budget_bytes",
    "swapped_bytes", "late_fetches", "predicted_step_s", "measured_step_s",
)  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeswap train")
    add_swap_train_arguments(parser)
    return parser


def _run(tmp_path: Path, name: str, *argv: str) -> dict[str, Any]:
    report = tmp_path / f"{name}.json"
    args = _parser().parse_args([*argv, "--device", "cpu", "--report", str(report)])
    assert run_data_parallel(args) == 0
    return json.loads(report.read_text())


GPT = ("--model", "gpt2-tiny", "--batch", "4", "--seq-len", "32", "--steps", "3")


def test_single_process_report_has_every_field_and_matches_no_swapping(tmp_path: Path) -> None:
    swapped = _run(tmp_path, "swap", *GPT, "--swap-policy", "disjoint", "--footprint-ratio", "1.5")
    plain = _run(tmp_path, "none", *GPT, "--swap-policy", "none", "--footprint-ratio", "1")
    for key in REPORT_KEYS:
        assert key in swapped, key
    assert swapped["format"] == "pipeswap.swaptrain/1"
    assert len(swapped["losses"]) == 1 and len(swapped["losses"][0]) == 3
    assert swapped["losses"] == plain["losses"]
    assert swapped["params_sha256"] == plain["params_sha256"]
    assert swapped["swapped_bytes"][0] > 0 == plain["swapped_bytes"][0]
    assert swapped["peak_resident_bytes"][0] <= swapped["saved_budget_bytes"][0]
    assert swapped["peak_resident_bytes"][0] < plain["peak_resident_bytes"][0]
    assert swapped["topology"] == "switch-4" and swapped["gpus"] == ["gpu0"]
    assert swapped["predicted_step_s"] > 0 and swapped["measured_step_s"] > 0


def test_no_swapping_under_a_budget_too_small_says_by_how_much(tmp_path: Path) -> None:
    args = _parser().parse_args(
        [*GPT, "--device", "cpu", "--swap-policy", "none", "--footprint-ratio", "1.5"]
    )
    with pytest.raises(PipeswapError, match=r"cannot keep its budget .* bytes \(.*MiB\) more"):
        run_data_parallel(args)


def test_bad_model_and_bad_options_are_refused() -> None:
    with pytest.raises(PipeswapError, match="gpt2-tiny"):
        run_data_parallel(_parser().parse_args(["--model", "gpt2-tiniest", "--device", "cpu"]))
    with pytest.raises(PipeswapError, match="--sync-every"):
        run_data_parallel(_parser().parse_args([*GPT, "--device", "cpu", "--sync-every", "0"]))
    with pytest.raises(SystemExit):  # argparse: the budget options exclude each other
        _parser().parse_args([*GPT, "--gpu-memory", "1GiB", "--footprint-ratio", "2"])


def test_options_extend_a_parser_that_has_the_shared_ones() -> None:
    from pipeswap.commands.train import add_training_arguments
    from pipeswap.pipeline.train import add_pipeline_arguments

    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    add_pipeline_arguments(parser)
    add_swap_train_arguments(parser)  # no clash with --model, --nproc, --device...
    args = parser.parse_args([*GPT, "--nproc", "2", "--swap-policy", "mip", "--sync-every", "2"])
    assert (args.nproc, args.swap_policy, args.sync_every, args.topology) == (2, "mip", 2, None)


def test_default_topology_on_cpu_is_a_preset_with_enough_gpus() -> None:
    assert default_topology("cpu", 2).name == "switch-4"
    assert len(default_topology("cpu", 6).gpus) == 8
    with pytest.raises(PipeswapError, match="--topology FILE"):
        default_topology("cpu", 9)


@pytest.mark.dist
def test_the_issue_command_on_two_ranks(tmp_path: Path) -> None:
    command = ("--model", "gpt2-tiny", "--batch", "8", "--seq-len", "64", "--steps", "5",
               "--nproc", "2")  # fmt: skip
    swapped = _run(tmp_path, "swap", *command, "--swap-policy", "disjoint", "--footprint-ratio", "1.5")
    plain = _run(tmp_path, "none", *command, "--swap-policy", "none", "--footprint-ratio", "1")
    for key in REPORT_KEYS:
        assert key in swapped, key
    assert len(swapped["losses"]) == 2 and all(len(r) == 5 for r in swapped["losses"])
    assert len(swapped["step_s"]) == 2 and all(len(r) == 5 for r in swapped["step_s"])
    assert swapped["losses"] == plain["losses"]
    assert swapped["params_sha256"] == plain["params_sha256"]
    assert len(set(swapped["params_sha256_per_rank"])) == 1
    assert swapped["gpus"] == ["gpu0", "gpu1"]
    assert all(b > 0 for b in swapped["swapped_bytes"])
    assert all(
        peak <= budget
        for peak, budget in zip(swapped["peak_resident_bytes"], swapped["saved_budget_bytes"])
    )


def test_a_cuda_rank_binds_its_gpu_before_the_first_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL runs the plan's broadcast on the current device: it must be the rank's own."""
    log: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(("bind", device)))

    def plan(request: Any, world_size: int, device: torch.device) -> dict[str, Any]:
        log.append(("plan", device))
        raise PipeswapError("stop after planning")

    monkeypatch.setattr(train_cli, "_plan", plan)
    request = train_cli._Request(
        job=ZooJob("gpt2-tiny", 2, seq_len=8), settings=TrainSettings(steps=1, device="cuda"),
        policy="none", gpu_memory_bytes=None, footprint_ratio=None, topology=None,
        time_limit_s=1.0, profile_path=None, report_path=None, timeout_s=1.0,
    )  # fmt: skip
    with pytest.raises(PipeswapError, match="stop after planning"):
        train_cli.run_rank(0, 1, request, local_rank=1)
    gpu = torch.device("cuda", 1)
    assert log == [("bind", gpu), ("plan", gpu)]
