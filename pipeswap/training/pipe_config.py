"""The TrainConfig a user's Pipeline runs: what ``pipeswap train --pipeline`` is given for it."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from pipeswap.data_config import DataConfig
from pipeswap.models.base import LayeredModel
from pipeswap.optim import OptimizerConfig
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig

__all__ = ["PipeSettings", "pipe_train_config"]


class PipeSettings(Protocol):
    """What a Pipeline was built with (pipeswap.training.pipe.Pipeline's attributes)."""

    pipeline: PipelineConfig
    optim: OptimizerConfig
    device: torch.device
    steps: int | None
    seed: int
    precision: str


def pipe_train_config(model: LayeredModel, inputs: torch.Tensor, pipe: PipeSettings) -> TrainConfig:
    """The run's config, shaped by the first batch (its size; its length or image size).

    Without ``steps`` the schedule's horizon decides how far the actions go
    (pipeswap.pipeline.horizon), so the config's own steps is 1; the user's loop holds the
    data, so the config has no held-out batches of its own.
    """
    lm, pipeline = model.task_entry.has_seq_len, pipe.pipeline
    return TrainConfig(
        model.name,
        batch=int(inputs.shape[0]),
        seq_len=int(inputs.shape[1]) if lm else None,
        image_size=None if lm else int(inputs.shape[-1]),
        steps=pipe.steps or 1,
        seed=pipe.seed,
        device=pipe.device.type,
        precision=pipe.precision,
        optim=pipe.optim,
        pipeline=replace(pipeline, micro_batches=pipeline.micro_batch_count),
        dataset=DataConfig(eval_batches=0),
        progress=False,
    )
