"""Backends, devices, joining a job (and why it failed), the one-thread guard, collectives.

Covers: pipeswap/dist/group.py, pipeswap/dist/env.py.
"""

from __future__ import annotations

import pickle
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeswap.config_fields import ConfigError
from pipeswap.dist.env import RankEnv, free_port, torchrun_env
from pipeswap.dist.group import (
    agree,
    all_gather,
    backend_for,
    broadcast_from_rank0,
    gather_to_rank0,
    init_process_group,
    pair_groups,
    rank_and_world,
    rank_device,
    rendezvous_error,
    single_threaded,
)
from pipeswap.dist.launch import spawn
from pipeswap.errors import PipeswapError


def test_nccl_only_when_each_local_rank_has_a_gpu_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
    assert pair_groups([(0, 1), (1, 0)]) == {}
    assert broadcast_from_rank0({"a": 1}, 1) == {"a": 1}
    assert all_gather(3, 1) == [3] and gather_to_rank0(3, 0, 1) == [3]
    agree(None, 1)
    with pytest.raises(PipeswapError, match="^bad plan$"):
        agree(PipeswapError("bad plan"), 1)
    # A config error stays one, its fields still placeholders (the CLI spells them as flags).
    with pytest.raises(ConfigError) as info:
        agree(ConfigError("{text_field} is wrong"), 1)
    assert info.value.message == "{text_field} is wrong"
    assert pickle.loads(pickle.dumps(info.value)).message == "{text_field} is wrong"


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


def test_a_port_in_use_is_refused_fast_naming_it() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(PipeswapError) as info:
            init_process_group(RankEnv(0, 1, 0, "127.0.0.1", port), timeout_s=2)
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"rendezvous at 127.0.0.1:{port}: port {port} is already in use" in message
    assert "pick another MASTER_PORT, or unset RANK, WORLD_SIZE, MASTER_ADDR" in message
    assert elapsed < 2  # refused at once, not after the timeout
    assert not dist.is_initialized()


def test_nobody_at_the_address_names_it_and_what_to_check() -> None:
    # Rank 1 of 2 with no rank 0 listening: torch's client times out connecting.
    port = free_port()
    with pytest.raises(PipeswapError) as info:
        init_process_group(RankEnv(1, 2, 1, "127.0.0.1", port), timeout_s=1)
    message = str(info.value)
    assert f"rank 1 of 2 found no complete job at 127.0.0.1:{port} within 1 s" in message
    assert "check that MASTER_ADDR and MASTER_PORT name rank 0's machine" in message
    assert not dist.is_initialized()
    waited = rendezvous_error(
        dist.DistStoreError("Timed out after 3 seconds waiting for clients. 1/2 clients joined."),
        RankEnv(0, 2, 0, "127.0.0.1", 1234),
        2,
    )
    assert isinstance(waited, PipeswapError) and "1/2 clients joined" in str(waited)
    other = RuntimeError("something else")
    assert rendezvous_error(other, RankEnv(0, 2, 0, "127.0.0.1", 1234), 2) is other


def _pair_exchange(rank: int, world: int) -> tuple[list[tuple[int, int]], float | None]:
    """Ranks 0 and 2 swap a tensor through their pair groups; rank 1 is in none of them."""
    groups = pair_groups([(0, 2), (2, 0)])
    got = None
    if rank in (0, 2):
        peer = 2 - rank
        send = dist.isend(torch.full((3,), float(rank + 1)), dst=peer, group=groups[(rank, peer)])
        buffer = torch.empty(3)
        dist.irecv(buffer, src=peer, group=groups[(peer, rank)]).wait()  # type: ignore[union-attr]
        send.wait()  # type: ignore[union-attr]
        got = float(buffer.sum())
    return sorted(groups), got


@pytest.mark.dist
def test_pair_groups_carry_one_direction_between_two_ranks() -> None:
    launched = spawn(_pair_exchange, 3, timeout_s=60)
    assert launched.ok, launched.exit_codes
    assert launched.results[0] == ([(0, 2), (2, 0)], 9.0)  # rank 2 sent 3 x 3.0
    assert launched.results[1] == ([], None)
    assert launched.results[2] == ([(0, 2), (2, 0)], 3.0)


def _slow_rank_0(rank: int, world: int, patient: bool) -> Any:
    if rank == 0:
        time.sleep(3.5)  # planning under contention, longer than the run's timeout
    return broadcast_from_rank0("the plan", world, patient=patient)


def test_a_rank_waits_for_rank_0_s_plan_beyond_the_run_s_timeout() -> None:
    """Hostile input round 4: under load, rank 1 timed out after 60 s while rank 0 was
    still planning; a patient broadcast waits, while other collectives keep the timeout."""
    waited = spawn(_slow_rank_0, 2, True, timeout_s=2)
    assert waited.ok and list(waited.results) == ["the plan", "the plan"], waited
    impatient = spawn(_slow_rank_0, 2, False, timeout_s=2)
    assert not impatient.ok  # the run's own timeout, as before
