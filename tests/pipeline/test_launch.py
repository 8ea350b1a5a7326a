"""Local launch: a rank that dies makes the others exit non-zero within the timeout.

Covers: pipeswap/pipeline/launch.py.
"""

from __future__ import annotations

import pytest

from pipeswap.pipeline.config import PipelineConfig
from pipeswap.pipeline.executor import FAULT_ENV
from pipeswap.pipeline.launch import free_port, spawn, torchrun_env
from pipeswap.pipeline.runtime import run_rank


def _train(rank: int, world: int, config: PipelineConfig) -> float | None:
    result = run_rank(config)
    return None if result is None else result.losses[-1]


@pytest.mark.dist
def test_dead_rank_makes_the_others_exit_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    timeout = 10.0
    monkeypatch.setenv(FAULT_ENV, "2:3")  # rank 2 dies (os._exit(17)) at step 3
    config = PipelineConfig(
        "gpt2-micro",
        (1, 1, 1, 1),
        batch=4,
        seq_len=16,
        steps=50,
        schedule="async-1f1b",
        timeout_s=timeout,
    )
    launched = spawn(_train, 4, config, timeout_s=timeout, grace_s=timeout + 20)
    assert launched.exit_codes[2] == 17
    # Every survivor noticed by itself (none had to be killed) and failed.
    assert launched.killed == ()
    assert all(code not in (0, None) for code in launched.exit_codes)
    # Start-up (a few seconds) plus at most one timeout, far from a hang.
    assert launched.elapsed_s < timeout + 15


def test_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() is None
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "1234")
    env = torchrun_env()
    assert env is not None and (env.rank, env.world_size, env.local_rank) == (2, 4, 2)
    assert env.master_port == 1234 and 0 < free_port() < 65536
