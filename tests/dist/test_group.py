"""Backends, devices, the single-thread guard and the collectives' one-process forms.

Covers: pipeswap/dist/group.py, pipeswap/dist/env.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeswap.dist.env import free_port, torchrun_env
from pipeswap.dist.group import (
    agree,
    all_gather,
    backend_for,
    broadcast_from_rank0,
    gather_to_rank0,
    rank_and_world,
    rank_device,
    single_threaded,
)
from pipeswap.errors import PipeswapError


def test_nccl_only_when_each_local_rank_has_a_gpu_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert backend_for("cuda", 1) == "nccl"
    assert backend_for("cuda", 2) == "gloo"  # two ranks on one GPU: NCCL would refuse them
    assert backend_for("cpu", 1) == "gloo"
    assert rank_device("cuda", 1) == torch.device("cuda", 0)  # they share GPU 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert backend_for("cuda", 4) == "nccl"
    assert rank_device("cuda", 3) == torch.device("cuda", 3)
    assert rank_device("cpu", 3) == torch.device("cpu")


def test_single_threaded_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    with single_threaded():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_one_process_collectives_need_no_group() -> None:
    assert rank_and_world() == (0, 1)
    assert broadcast_from_rank0({"a": 1}, 1) == {"a": 1}
    assert all_gather(3, 1) == [3] and gather_to_rank0(3, 0, 1) == [3]
    agree(None, 1)
    with pytest.raises(PipeswapError, match="^bad plan$"):
        agree("bad plan", 1)


def test_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() is None
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "1234")
    env = torchrun_env()
    assert env is not None and (env.rank, env.world_size, env.local_rank) == (2, 4, 2)
    assert env.master_port == 1234 and env.local_ranks == 4 and 0 < free_port() < 65536
