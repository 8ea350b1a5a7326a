"""pipeswap/dist/ddp.py: replication over a process group, and local accumulation."""

from __future__ import annotations

import pytest
import torch

from pipeswap.dist.ddp import accumulating, replicate, unwrap
from pipeswap.dist.launch import spawn


def test_one_rank_trains_the_model_itself() -> None:
    model = torch.nn.Linear(2, 2)
    assert replicate(model, torch.device("cpu"), 2**20, 1) is model
    with accumulating(model, sync=False):
        pass


def _replicated_gradients(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    network = replicate(model, torch.device("cpu"), 2**20, world)
    x = torch.full((1, 2), float(rank + 1))
    with accumulating(network, sync=False):
        network(x).sum().backward()  # kept local: no all-reduce yet
    local = model.weight.grad.clone()  # type: ignore[union-attr]
    with accumulating(network, sync=True):
        network(x).sum().backward()  # the second micro-batch syncs both
    return [*local.flatten().tolist(), *model.weight.grad.flatten().tolist()]  # type: ignore[union-attr]


@pytest.mark.dist
def test_gradients_accumulate_locally_then_average_over_ranks() -> None:
    launched = spawn(_replicated_gradients, 2, timeout_s=60)
    assert launched.ok, launched.exit_codes
    rank0, rank1 = launched.results
    assert rank0[:2] == [1.0, 1.0] and rank1[:2] == [2.0, 2.0]  # local only
    # Synced: the mean over ranks of (local + this micro-batch's) gradient.
    assert rank0[2:] == rank1[2:] == [3.0, 3.0]


def _offload_of_a_sharded_model(rank: int, world: int) -> str:
    from torch.distributed.fsdp import fully_shard

    from pipeswap.errors import PipeswapError
    from pipeswap.training.offload import offload

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    try:
        offload(model, footprint_ratio=1.5, layers=["0", "1"])
    except PipeswapError as refused:
        return str(refused)
    return "accepted"


@pytest.mark.dist
def test_a_model_sharded_by_fsdp_is_refused_saying_what_to_use() -> None:
    """Under fully_shard, FSDP gathers and frees each layer's parameters itself: plans held
    1.05-1.16x their budgets on 2 ranks (a Llama, auto and hybrid), silently."""
    launched = spawn(_offload_of_a_sharded_model, 1, timeout_s=60)
    assert launched.ok, launched.exit_codes
    (said,) = launched.results
    assert "does not support a model sharded by FSDP" in said
    assert "DistributedDataParallel" in said


def test_unwrap_gives_what_ddp_wraps_and_any_other_module_as_it_is() -> None:
    model = torch.nn.Linear(2, 2)
    assert unwrap(model) is model
