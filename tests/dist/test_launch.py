"""Launching ranks: one process, local spawn, and one error that names the failing rank.

Covers: pipeswap/dist/launch.py, pipeswap/dist/faults.py.
"""

from __future__ import annotations

import signal

import pytest
from support import pipeline_run

from pipeswap.dist.faults import FAULT_ENV, fault_hook
from pipeswap.dist.launch import RankFailedError, run_ranks, spawn
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.runtime import run_stage_rank
from pipeswap.train_config import TrainConfig


def _train(rank: int, world: int, config: TrainConfig) -> float | None:
    result = run_stage_rank(config)
    return None if result is None else result.losses[-1]


def _echo(rank: int, world: int, value: int) -> tuple[int, int, int]:
    return rank, world, value


def _refuse_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise PipeswapError("the budget is too small; pass --gpu-memory 2GiB")
    return rank


@pytest.mark.dist
def test_dead_rank_makes_the_others_exit_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    timeout = 10.0
    monkeypatch.setenv(FAULT_ENV, "2:3")  # rank 2 kills itself after its step 3
    config = pipeline_run(
        "gpt2-micro",
        (1, 1, 1, 1),
        batch=4,
        seq_len=16,
        steps=50,
        schedule="async-1f1b",
        timeout_s=timeout,
    )
    launched = spawn(_train, 4, config, timeout_s=timeout, grace_s=timeout + 20)
    assert launched.exit_codes[2] == -signal.SIGKILL and launched.first_failed == 2
    # Every survivor noticed by itself (none had to be killed) and failed.
    assert launched.killed == ()
    assert all(code not in (0, None) for code in launched.exit_codes)
    # Start-up (a few seconds) plus at most one timeout, far from a hang.
    assert launched.elapsed_s < timeout + 15
    with pytest.raises(RankFailedError, match="^rank 2 was killed by SIGKILL") as info:
        launched.raise_failure()
    assert info.value.exit_status == 1


@pytest.mark.dist
def test_run_ranks_returns_rank_0s_value_and_names_a_refusing_rank() -> None:
    assert run_ranks(_echo, 1, 7) == (0, 1, 7)  # one rank: this process, no group
    assert run_ranks(_echo, 2, 7) == (0, 2, 7)
    with pytest.raises(PipeswapError, match=r"^rank 1: the budget is too small") as info:
        run_ranks(_refuse_on_rank_1, 2)
    assert not isinstance(info.value, RankFailedError)  # bad input: the CLI exits 2
    with pytest.raises(PipeswapError, match="nproc is 0"):
        run_ranks(_echo, 0, 7)


def test_the_fault_hook_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert fault_hook(0) is None
    monkeypatch.setenv(FAULT_ENV, "1:4")
    assert fault_hook(0) is None and fault_hook(1) is not None
    monkeypatch.setenv(FAULT_ENV, "one")
    with pytest.raises(PipeswapError, match="RANK:STEP"):
        fault_hook(0)
