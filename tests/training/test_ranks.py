"""pipeswap/training/ranks.py: more ranks than the machine holds are refused up front."""

from __future__ import annotations

import time

import pytest

from pipeswap.cli import main
from pipeswap.config_fields import ConfigError
from pipeswap.dist.threads import usable_cpus
from pipeswap.optim import OptimizerConfig
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training import ranks
from pipeswap.training.ranks import (
    EMULATED_RANK_BYTES,
    PROCESS_RANK_BYTES,
    RANKS_PER_CORE,
    check_ranks,
)

GPT = ["train", "--model", "gpt2-micro", "--batch", "4", "--steps", "1"]
# The bounds below count SGD's one state buffer (every model's default when they were set).
SGD = OptimizerConfig(optimizer="sgd")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "2000"], "--nproc 2000 asks for 2,000 local processes"),
        (
            ["--pipeline", "2", "--replicas", "1000", "--nproc", "2000"],
            "--pipeline 2 x --replicas 1000 (--nproc 2000) asks for 2,000 local processes",
        ),
        (
            ["--pipeline", "2", "--replicas", "1000000", "--emulate"],
            "--emulate of --pipeline 2 x --replicas 1000000 holds 2,000,000 ranks",
        ),
    ],
)
def test_ranks_beyond_the_machine_exit_2_before_anything_starts(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    # Before: 2000 processes were being spawned (146 after 2 minutes); a million emulated
    # replicas grew by 18 MB/s without a word.
    started = time.perf_counter()
    assert main([*GPT, *argv]) == 2
    assert time.perf_counter() - started < 30
    err = capsys.readouterr().err
    assert message in err and "at most" in err
    assert "lower --replicas" in err or "lower --nproc" in err


def test_the_process_bound_names_cores_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "usable_cpus", lambda: 3)
    check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, nproc=3 * RANKS_PER_CORE, device="cpu"))
    with pytest.raises(ConfigError) as refused:
        check_ranks(
            TrainConfig(model="gpt2-micro", optim=SGD, nproc=3 * RANKS_PER_CORE + 1, device="cpu")
        )
    text = str(refused.value)
    assert f"nproc {3 * RANKS_PER_CORE + 1} asks for" in text
    assert f"at most {3 * RANKS_PER_CORE} ({RANKS_PER_CORE} ranks a core x 3 cores" in text
    assert "a rank = " in text and "spread the ranks over machines with torchrun" in text
    # Memory binds first on a small machine: each rank's interpreter and CPU model.
    monkeypatch.setattr(ranks, "memory_bytes", lambda device: 2 * PROCESS_RANK_BYTES)
    with pytest.raises(ConfigError, match=r"at most 1 \(.*= 12; 512.00 MiB / 256\.\d+ MiB a rank"):
        check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, nproc=2, device="cpu"))


def test_an_emulated_pipeline_is_bounded_by_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "memory_bytes", lambda device: 100 * EMULATED_RANK_BYTES)
    pipeline = PipelineConfig(stages=2, emulate=True, replicas=10)
    check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, pipeline=pipeline, device="cuda"))
    many = PipelineConfig(stages=2, emulate=True, replicas=60)
    with pytest.raises(ConfigError, match=r"holds 120 ranks .* at most 50 replicas fit"):
        check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, pipeline=many, device="cuda"))
    # On the CPU each replica also holds its model, gradients and optimizer state.
    with pytest.raises(ConfigError, match=r"of weights, gradients and optimizer state\): at most"):
        check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, pipeline=many, device="cpu"))


def test_one_rank_and_the_usual_runs_are_never_refused() -> None:
    assert usable_cpus() >= 1
    check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, device="cpu"))
    check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, nproc=2, device="cpu"))
    pipeline = PipelineConfig(stages=2, replicas=2, emulate=True)
    check_ranks(TrainConfig(model="gpt2-micro", optim=SGD, pipeline=pipeline, device="cpu"))
