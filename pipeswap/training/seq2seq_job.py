"""What a data-parallel rank trains for an encoder-decoder: the model whole, its own loss, pairs.

An encoder-decoder is no LayeredModel (pipeswap.models.seq2seq), so it is profiled as a
user's loop is (pipeswap.training.loop_profile): one step timed by hooks at its blocks,
the tensors each block saves named by one forward, and the device's meter read at every
block's edge. The rest of a data-parallel run (plan, executor, DDP, checkpoints, held-out
score, ``--save``) is the one every model takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.data_config import DataConfig
from pipeswap.models.scored import scored_targets
from pipeswap.models.seq2seq import Seq2SeqModel, load_seq2seq
from pipeswap.models.state import untouched
from pipeswap.profiling.metered_step import module_step_memory
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.step import parse_dtype
from pipeswap.swap.runtime.capture import resolve_layers
from pipeswap.swap.runtime.recompute_sizes import measure_recomputation
from pipeswap.train_config import TrainConfig
from pipeswap.training.loop_profile import loop_profile
from pipeswap.user_pairs import PairDataset, tokenize_pairs

__all__ = ["Seq2SeqJob"]

_NOTE = (
    "pipeswap train, an encoder-decoder: one step of the whole model run aside, timed by "
    "hooks at its blocks and metered at their edges (as pipeswap.offload profiles a loop)"
)


@dataclass(frozen=True)
class Seq2SeqJob:
    """An encoder-decoder from a Hugging Face directory on the user's source/target pairs."""

    model: str
    batch_size: int
    seq_len: int
    seed: int = 0
    dtype: str = "float32"
    data: DataConfig = DataConfig()
    image_size: int | None = None  # a job's shape, as ModelJob has it: none here

    @classmethod
    def of(cls, config: TrainConfig) -> Seq2SeqJob:
        """What a resolved config of an encoder-decoder trains."""
        assert config.batch is not None and config.seq_len is not None, "a resolved config"
        return cls(config.model, config.batch, config.seq_len, config.seed, data=config.dataset)

    @property
    def layers(self) -> list[str]:
        return _facts(self.model)[0]

    def build(self, device: torch.device) -> Seq2SeqModel:
        model = load_seq2seq(self.model, device=device, seed=self.seed)
        return model.to(dtype=parse_dtype(self.dtype))

    def loss(
        self, model: torch.nn.Module, output: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        del model, targets  # the model's own loss is its output
        return output

    def scored_items(self, targets: torch.Tensor) -> int:
        """What the model's own loss averages over: its labels that are not IGNORE_INDEX
        (an encoder-decoder scores them in place), so micro-batches and ranks of pairs of
        every length weigh their share of them (pipeswap.training.dp_rank)."""
        return scored_targets(targets)

    def batch(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of the ``split`` (train, or val: the held-out pairs)."""
        source = self.data.source(split)
        fields = (self.data.source_field, self.data.target_field)
        if source is None or fields[0] is None or fields[1] is None:
            raise ConfigError(
                f"{self.model} is an encoder-decoder: give {{data}} PATH with "
                "{source_field} and {target_field}"
            )
        try:
            dataset = _dataset(
                self.model,
                source.path,
                (fields[0], fields[1]),
                self.seq_len,
                source.part,
                self.seed,
            )
            return dataset.batch(self.batch_size, index)
        except ConfigError as exc:
            if split == "train" or source.part != "all":
                raise
            # The held-out pairs read from their own file: what was wrong is --eval-data's.
            raise ConfigError(exc.message.replace("{data}", "{eval_data}")) from None

    def profile(self, device: torch.device, optimizer: str) -> Profile:
        """The planner's view of one step (run under the caller's autocast)."""
        model = self.build(device)
        model.train()
        inputs, targets = (t.to(device) for t in self.batch(0))
        layers = resolve_layers(model, self.layers)
        names = list(layers)

        def forward() -> torch.Tensor:
            return model(inputs)

        with untouched(model):
            sizes = measure_recomputation(model, layers, names, forward)
        timing, memory = module_step_memory(
            model, forward, layers, device, optimizer, holding=(model, inputs, targets)
        )
        profile = loop_profile(
            model,
            layers,
            sizes,
            timing,
            ((inputs,), {}),
            optimizer=optimizer,
            memory=memory,
        )
        return replace(profile, seq_len=self.seq_len, notes={"source": _NOTE})


@functools.lru_cache(maxsize=4)
def _facts(model: str) -> tuple[list[str], int, int]:
    """The model's blocks, vocabulary and pad token, read off it built on the meta device."""
    built = load_seq2seq(model, device="meta")
    return built.layer_names, built.vocab_size, built.pad_token_id


@functools.lru_cache(maxsize=8)
def _dataset(
    model: str, path: str, fields: tuple[str, str], seq_len: int, part: str, seed: int
) -> PairDataset:
    _, vocab_size, pad = _facts(model)
    sources, lengths, labels = _tokenized(model, path, fields, seq_len, vocab_size, pad)
    return PairDataset(sources, lengths, labels, split=part, seed=seed, where=path)


@functools.lru_cache(maxsize=4)
def _tokenized(
    model: str, path: str, fields: tuple[str, str], seq_len: int, vocab_size: int, pad: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs of ``path``, tokenized once per run (both splits share them)."""
    return tokenize_pairs(model, path, fields, seq_len, vocab_size=vocab_size, pad_token_id=pad)
