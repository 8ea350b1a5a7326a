"""The arithmetic every replicated run averages with, and the (data, pipe) mesh.

Covers: pipeswap/dist/replica_groups.py (the mesh runs in tests/pipeline/test_replicated.py).
"""

from __future__ import annotations

import pytest
import torch

from pipeswap.config import ConfigError
from pipeswap.dist.replica_groups import mean_in_order
from pipeswap.pipeline.config import PipelineConfig
from pipeswap.pipeline.resolve import resolve_pipeline
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
