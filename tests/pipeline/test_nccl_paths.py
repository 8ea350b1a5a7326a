"""NCCL paths checked on the CPU: one GPU per rank bound before the group, per-direction groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import pipeline_run

from pipeswap.config_fields import replace_fields
from pipeswap.dist import group
from pipeswap.dist.env import RankEnv, torchrun_env
from pipeswap.dist.group import init_process_group
from pipeswap.dist.launch import spawn
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.runtime import run_stage_rank
from pipeswap.train_config import TrainConfig


def _env(rank: int, world: int, local_world: int | None = None) -> RankEnv:
    return RankEnv(rank, world, rank, "127.0.0.1", 29500, local_world)


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[tuple[str, Any]]:
    """Pretend this machine has ``count`` GPUs; log set_device and group creation."""
    log: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(("set_device", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        group.dist, "init_process_group", lambda backend, **kw: log.append(("init", backend))
    )
    # No rendezvous either: the store it would hand over is only passed on.
    monkeypatch.setattr(
        group.dist, "rendezvous", lambda url, rank, world, **kw: iter([(None,) * 3])
    )
    monkeypatch.setattr(group.dist, "PrefixStore", lambda prefix, store: store)
    return log


def test_nccl_binds_each_rank_to_its_gpu_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _fake_gpus(monkeypatch, 2)
    init_process_group(_env(1, 2), backend="nccl", timeout_s=60)
    assert log == [("set_device", 1), ("init", "nccl")]


def test_gloo_leaves_the_current_device_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _fake_gpus(monkeypatch, 1)
    init_process_group(_env(1, 2), backend="gloo", timeout_s=60)
    assert log == [("init", "gloo")]


def test_two_nccl_ranks_on_one_gpu_are_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = _fake_gpus(monkeypatch, 1)
    with pytest.raises(PipeswapError, match="2 ranks on 1 GPU.*gloo"):
        init_process_group(_env(0, 2), backend="nccl", timeout_s=60)
    # On a multi-machine job only this machine's ranks need GPUs here.
    init_process_group(_env(0, 4, local_world=1), backend="nccl", timeout_s=60)
    with pytest.raises(PipeswapError, match="needs CUDA GPUs"):
        _fake_gpus(monkeypatch, 0)
        init_process_group(_env(0, 1), backend="nccl", timeout_s=60)
    assert log == [("set_device", 0), ("init", "nccl")]


def test_torchrun_env_reads_the_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    env = torchrun_env()
    assert env is not None and (env.rank, env.local_rank, env.local_world_size) == (3, 1, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert torchrun_env().local_world_size is None  # type: ignore[union-attr]


# ---- per-direction process groups (what NCCL uses), run over gloo -------------------------
def _split_runs(rank: int, world: int, configs: list[TrainConfig]) -> list[dict | None]:
    out = []
    for config in configs:
        result = run_stage_rank(config, split_directions=True)
        out.append(None if result is None else result.to_report())
    return out


@pytest.mark.dist
def test_per_direction_groups_train_bit_for_bit_like_the_emulator() -> None:
    base = pipeline_run("gpt2-micro", (2, 1, 1), batch=8, seq_len=16, steps=3)
    configs = [
        replace_fields(base, schedule=s, micro_batches=m)
        for s, m in (("gpipe", 4), ("1f1b", 4), ("async-1f1b", 1))
    ]
    launched = spawn(_split_runs, 3, configs, timeout_s=60)
    assert launched.ok, launched.exit_codes
    for config, runtime in zip(configs, launched.results[0]):
        emulated = Emulator(config).run().to_report()
        assert runtime["losses"] == emulated["losses"], config.require_pipeline().schedule
        assert runtime["params_sha256"] == emulated["params_sha256"], (
            config.require_pipeline().schedule
        )
