"""A Hugging Face encoder-decoder (T5, BART) as one module trained on packed source/target batches.

Replay splitting (pipeswap.models.replay) cuts one stack of blocks that feed each other
directly; an encoder-decoder has two, and every decoder block reads the encoder's output
(T5's blocks also pass on a position bias the first one computes), so it is not cut into
a LayeredModel. It trains whole instead: :class:`Seq2SeqModel` runs the model's own
forward with ``labels`` and returns the model's own loss, and swap plans cut at its
blocks, the encoder's then the decoder's, in the order the forward runs them (the backward
runs them in reverse, as for one stack).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import load_json
from pipeswap.models.blocks import find_blocks
from pipeswap.models.load import load_hf_model

__all__ = [
    "ROWS",
    "Seq2SeqModel",
    "is_encoder_decoder",
    "load_seq2seq",
    "max_positions",
    "stack_blocks",
]

# The rows of a packed batch [B, 3, L]: source token ids, the source's attention mask
# (1: a token, 0: padding), labels (the target's token ids, IGNORE_INDEX past its end).
SOURCE, MASK, LABELS = 0, 1, 2
ROWS = 3


def is_encoder_decoder(name: str) -> bool:
    """Whether ``name`` is a Hugging Face model directory whose config says it is an
    encoder-decoder (``is_encoder_decoder``, which save_pretrained writes)."""
    config = Path(name) / "config.json"
    if not os.path.isdir(name) or not config.is_file():
        return False
    try:
        raw = load_json(config)
    except PipeswapError:
        return False  # loading the model says what is wrong with it
    return raw.get("is_encoder_decoder") is True


class Seq2SeqModel(nn.Module):
    """An encoder-decoder with a language-model head, called on packed batches.

    ``forward(packed)``: ``packed`` is ``[B, 3, L]`` int64 (rows :data:`SOURCE`,
    :data:`MASK`, :data:`LABELS`); it returns the model's own loss of the labels (its
    decoder input is the labels shifted right, as the model makes it), the mean over the
    tokens that are not IGNORE_INDEX. ``layer_names`` are the blocks swap plans cut at,
    as paths inside this module, encoder blocks then decoder blocks.
    """

    def __init__(self, model: nn.Module, name: str) -> None:
        super().__init__()
        self.model = model
        self.name = name
        self.task = "lm"
        self.encoder_decoder = True
        self.layer_names = [f"model.{path}" for path in stack_blocks(model)]
        config: Any = model.config
        self.vocab_size = int(config.vocab_size)
        self.pad_token_id = int(config.pad_token_id)

    @property
    def wrapped(self) -> nn.Module:
        """The Hugging Face model (what ``save_pretrained`` writes)."""
        return self.model

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        # Rows of the packed batch are strided views; the model's loss views its labels flat.
        output = self.model(
            input_ids=packed[:, SOURCE].contiguous(),  # [B, L]
            attention_mask=packed[:, MASK].contiguous(),  # [B, L]
            labels=packed[:, LABELS].contiguous(),  # [B, L]
            use_cache=False,  # a cache would keep every block's keys and values
            return_dict=True,
        )
        return output.loss

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The forward's output is the model's own loss already."""
        del targets  # they are in the packed batch the forward read
        return output


def stack_blocks(model: nn.Module) -> list[str]:
    """The block paths of ``model``'s encoder, then its decoder (each stack's repeated list)."""
    paths = {id(module): path for path, module in model.named_modules()}
    found: list[str] = []
    for getter in ("get_encoder", "get_decoder"):
        stack = getattr(model, getter)()
        where = paths.get(id(stack))
        if where is None:
            raise PipeswapError(
                f"{type(model).__name__}.{getter}() returns a module outside the model; "
                "pipeswap cuts encoder-decoders whose stacks are their own submodules"
            )
        found += [f"{where}.{block}" if where else block for block in find_blocks(stack)]
    return found


def load_seq2seq(
    name: str, *, device: torch.device | str = "cpu", seed: int | None = 0
) -> Seq2SeqModel:
    """The encoder-decoder saved in directory ``name``, ready to train on packed batches."""
    model = load_hf_model(name, device=device, seed=seed)
    cls = type(model).__name__
    if cls not in _seq2seq_lm_classes():
        raise PipeswapError(
            f"{name}: {cls} is an encoder-decoder without a language-model head; pipeswap "
            "trains encoder-decoders that generate text (AutoModelForSeq2SeqLM classes such "
            "as T5ForConditionalGeneration, BartForConditionalGeneration): save one of those"
        )
    config: Any = model.config
    for key in ("pad_token_id", "decoder_start_token_id"):
        if getattr(config, key, None) is None:
            raise PipeswapError(
                f"{name}/config.json sets no {key}, which {cls} needs to make its decoder's "
                f"input from the labels; set {key} (its tokenizer's pad token id, for T5 0)"
            )
    return Seq2SeqModel(model, name)


def _seq2seq_lm_classes() -> set[str]:
    # Imported by name: transformers is optional, and loaded already for a Hugging Face model.
    auto: Any = importlib.import_module("transformers.models.auto.modeling_auto")
    found: set[str] = set()
    for value in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values():
        found.update((value,) if isinstance(value, str) else value)
    return found


def max_positions(model: Seq2SeqModel) -> int | None:
    """The longest sequence the model's position embeddings take (None: any, as T5's
    relative positions)."""
    config: Any = model.model.config
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) else None
