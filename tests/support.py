"""Shared test support: configs of small pipeline runs."""

from __future__ import annotations

from typing import Any

from pipeswap.config import replace_fields
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.config import PipelineConfig
from pipeswap.train_config import TrainConfig


def pipeline_run(
    model: str,
    balance: tuple[int, ...],
    *,
    batch: int = 8,
    steps: int = 10,
    lr: float = 0.01,
    micro_batches: int = 1,
    **fields: Any,
) -> TrainConfig:
    """A pipeline run of ``model`` cut at ``balance``, with the small defaults the pipeline
    tests were written for (batch 8, 10 steps, SGD at 0.01, one micro-batch); ``fields``
    sets any other field of the config tree by name (``schedule="gpipe"``, ``seq_len=16``)."""
    base = TrainConfig(
        model,
        batch=batch,
        steps=steps,
        optim=OptimizerConfig(lr=lr),
        pipeline=PipelineConfig(balance=balance, micro_batches=micro_batches),
    )
    return replace_fields(base, **fields) if fields else base
