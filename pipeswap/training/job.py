"""What a data-parallel rank trains: a model, its loss and its batches, built on each rank."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.data import dataset_for
from pipeswap.data_config import DataConfig, UserData
from pipeswap.models.registry import build_model, model_spec
from pipeswap.profiling.step import parse_dtype
from pipeswap.train_config import TrainConfig
from pipeswap.training.seq2seq_job import Seq2SeqJob

__all__ = ["Job", "ModelJob", "check_user_data", "job_for"]


class Job(Protocol):
    """What to train; must pickle (it travels to spawned ranks).

    ``seed`` seeds the random streams of training (dropout); a job without one uses 0.
    """

    @property
    def layers(self) -> Sequence[str] | None: ...

    def build(self, device: torch.device) -> nn.Module: ...

    def loss(
        self, model: nn.Module, output: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor: ...

    def batch(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of ``split``: train, or val (the held-out data)."""
        ...


@dataclass(frozen=True)
class ModelJob:
    """A model by name (zoo, Hugging Face directory, module:function) on its offline data."""

    model: str
    batch_size: int
    seq_len: int | None = None
    image_size: int | None = None
    seed: int = 0
    dtype: str = "float32"
    data: DataConfig = DataConfig()  # the user's data, or the built-in data

    @classmethod
    def of(cls, config: TrainConfig) -> ModelJob:
        """What a resolved config trains."""
        assert config.batch is not None, "a resolved config has its batch size"
        return cls(
            config.model,
            config.batch,
            config.seq_len,
            config.image_size,
            config.seed,
            data=config.dataset,
        )

    @property
    def layers(self) -> Sequence[str] | None:
        return None  # the model's own blocks

    def build(self, device: torch.device) -> nn.Module:
        return build_model(
            self.model,
            device=device,
            dtype=parse_dtype(self.dtype),
            image_size=self.image_size,
            seed=self.seed,
        )

    def loss(self, model: nn.Module, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model.loss(output, targets)  # type: ignore[operator]

    def batch(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of the ``split`` (train, or val: the held-out data)."""
        source = self.data.source(split)
        dataset = _dataset(self.model, self.seq_len, self.image_size, self.seed, split, source)
        inputs, targets = dataset.batch(self.batch_size, index)
        if inputs.is_floating_point():
            inputs = inputs.to(parse_dtype(self.dtype))
        return inputs, targets


@functools.lru_cache(maxsize=8)
def _dataset(
    model: str,
    seq_len: int | None,
    image_size: int | None,
    seed: int,
    split: str,
    data: UserData | None,
) -> Any:
    try:
        return dataset_for(
            model, seq_len=seq_len, image_size=image_size, split=split, seed=seed, data=data
        )
    except ConfigError as exc:
        if split == "train" or data is None or data.part != "all":
            raise
        # The held-out split read from its own file: what was wrong is --eval-data's.
        raise ConfigError(exc.message.replace("{data}", "{eval_data}")) from None


def job_for(config: TrainConfig) -> ModelJob | Seq2SeqJob:
    """What a resolved config trains: an encoder-decoder whole on its pairs
    (pipeswap.training.seq2seq_job), any other model cut into layers on its data."""
    if model_spec(config.model).encoder_decoder:
        return Seq2SeqJob.of(config)
    return ModelJob.of(config)


def check_user_data(config: TrainConfig) -> None:
    """Read the first batch of the user's training data and, when it is scored, of the
    held-out data (a resolved config): data too small for one batch, unreadable files and
    the like are refused before any training, not after it."""
    if config.dataset.data is None:
        return
    job = job_for(config)
    job.batch(0)
    if config.dataset.eval_batches:
        job.batch(0, "val")
