"""The arithmetic every replicated run averages with, its buckets, and the (data, pipe) mesh.

Covers: pipeswap/dist/replica_groups.py (whole pipelines run in tests/pipeline/test_replicated.py).
"""

from __future__ import annotations

import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.dist.launch import spawn
from pipeswap.dist.replica_groups import ReplicaMesh, buckets_of, mean_in_order
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig


def test_the_mean_adds_in_replica_order_then_divides() -> None:
    a, b, c = torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])
    assert mean_in_order([a, b, c]).item() == 0.0  # float32: 1e8 + 1 rounds to 1e8
    assert mean_in_order([a, c, b]).item() == pytest.approx(1 / 3)  # another order, other bits
    assert mean_in_order([b]).item() == 1.0
    assert a.item() == 1e8  # the inputs stay as they were


def test_nproc_sets_the_replicas_and_a_mismatch_is_refused() -> None:
    base = TrainConfig("gpt2-micro", batch=4, steps=1, nproc=4, pipeline=PipelineConfig(stages=2))
    assert resolve_pipeline(base).require_pipeline().replicas == 2
    assert resolve_pipeline(base).require_pipeline().num_ranks == 4
    with pytest.raises(ConfigError, match="a multiple of 2"):
        TrainConfig("gpt2-micro", nproc=3, pipeline=PipelineConfig(stages=2))
    with pytest.raises(ConfigError, match="x replicas 3"):
        TrainConfig("gpt2-micro", nproc=4, pipeline=PipelineConfig(stages=2, replicas=3))
    with pytest.raises(ConfigError, match="replicas is 0; use 1"):
        PipelineConfig(stages=2, replicas=0)


def test_buckets_follow_the_backward_one_dtype_each_within_the_size() -> None:
    params = [
        torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        for n, dtype in (
            (4, torch.float32),
            (4, torch.float32),
            (2, torch.float32),
            (8, torch.bfloat16),
        )
    ]
    buckets = buckets_of(params, bucket_bytes=32)
    # Last parameter first; a new bucket at the dtype change and where 32 bytes overflow.
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b.params] for b in buckets] == [[3], [2, 1], [0]]
    assert [len(b.params) for b in buckets_of(params, bucket_bytes=1)] == [1, 1, 1, 1]


class _Stage:
    """Three layers of one rank: its gradients, in parameter order."""

    def __init__(self, rank: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
        self.x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))

    def gradient_params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]


def _average_two_ways(rank: int, world: int) -> tuple[int, bool]:
    """One rank of 2 replicas of a 1-stage pipeline: (buckets gathered during the
    backward, whether the averaged gradients equal an average after the backward)."""
    mesh = ReplicaMesh(world, 1, "cpu", bucket_bytes=64 * 65 * 4)  # one layer a bucket
    overlapped, after = _Stage(rank), _Stage(rank)
    mesh.start(0, overlapped)
    overlapped.model(overlapped.x).square().mean().backward()
    mesh(0, overlapped)
    during = mesh.gathered_in_backward
    after.model(after.x).square().mean().backward()
    mesh(0, after)  # no start: every bucket gathers now
    same = all(torch.equal(a, b) for a, b in zip(overlapped.gradients(), after.gradients()))
    return during, same and mesh.gathered_in_backward == during


@pytest.mark.dist
def test_buckets_gather_during_the_backward_and_average_to_the_same_bits() -> None:
    launched = spawn(_average_two_ways, 2, timeout_s=60)
    assert launched.ok, launched.exit_codes
    for during, same in launched.results:
        assert during == 3  # every layer's bucket started before the backward returned
        assert same
