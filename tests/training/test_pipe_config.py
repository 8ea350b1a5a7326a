"""The TrainConfig a user's Pipeline runs, shaped by its first batch (pipe_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeswap.models.registry import build_model
from pipeswap.optim import OptimizerConfig
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.training.pipe_config import pipe_train_config


@dataclass
class _Settings:
    pipeline: PipelineConfig = field(default_factory=lambda: PipelineConfig(stages=2))
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(optimizer="sgd"))
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    steps: int | None = None
    seed: int = 3
    precision: str = "fp32"


def test_a_language_models_batch_gives_its_size_and_length() -> None:
    model = build_model("gpt2-micro")
    config = pipe_train_config(model, torch.zeros(6, 24, dtype=torch.long), _Settings())
    assert (config.batch, config.seq_len, config.image_size) == (6, 24, None)
    # One micro-batch per stage by default, written out; steps left to the schedule.
    pipeline = config.require_pipeline()
    assert pipeline.micro_batches == pipeline.micro_batch_count == 2
    assert (config.steps, config.seed, config.optim.optimizer) == (1, 3, "sgd")
    assert config.dataset.eval_batches == 0 and not config.progress
    assert pipe_train_config(model, torch.zeros(6, 24), _Settings(steps=9)).steps == 9


def test_an_image_models_batch_gives_its_image_size() -> None:
    model = build_model("resnet-micro")
    config = pipe_train_config(model, torch.zeros(4, 3, 32, 32), _Settings())
    assert (config.batch, config.seq_len, config.image_size) == (4, None, 32)
