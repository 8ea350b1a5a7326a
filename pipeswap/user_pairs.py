"""A user's source/target pairs (JSON lines, CSV, Parquet) as encoder-decoder batches, read offline.

Each row of the table is an example: the text of its source field (the encoder's input)
and of its target field (what the decoder learns to write). Both are tokenized with the
model directory's own tokenizer, its special tokens added as it adds them (T5's ends each
text with ``</s>``), cut to ``seq_len`` tokens and padded to it: the source with the
model's pad token and an attention mask of 0 there, the labels with IGNORE_INDEX (-100),
which the model's own loss skips. Every batch has one shape, so one swap plan serves the
run. The last 5% of the rows (at least one) are held out (part ``val``, the rest
``train``) unless the held-out data is a file of its own (part ``all``); batch ``index``
takes rows in an order drawn from ``(seed, epoch)``, as the windows of pipeswap.user_data.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError, first_line
from pipeswap.models.base import IGNORE_INDEX
from pipeswap.models.seq2seq import LABELS, MASK, ROWS, SOURCE
from pipeswap.units import format_bytes
from pipeswap.user_data import (
    HELD_OUT_FRACTION,
    TABLE_SUFFIXES,
    TOKENIZER_FILES,
    EpochOrder,
    load_table,
)
from pipeswap.user_files import MAX_TEXT_BYTES, check_tree, require_regular

__all__ = ["PairDataset", "load_seq2seq_tokenizer", "read_pairs", "tokenize_pairs"]

_FORMATS = ".jsonl, .csv, .parquet or .arrow file, or a save_to_disk directory"


def read_pairs(path: str, source_field: str, target_field: str) -> tuple[list[str], list[str]]:
    """The source and target texts of every row of the table ``path``."""
    if not os.path.lexists(path):
        raise ConfigError(f"{{data}} {path} does not exist; give a {_FORMATS}")
    suffix = Path(path).suffix.lower()
    if os.path.isdir(path):
        if not (Path(path) / "dataset_info.json").is_file():
            raise ConfigError(
                f"{{data}} {path} is a directory but no saved dataset; an encoder-decoder "
                f"trains on a table of source/target pairs: give a {_FORMATS}"
            )
        check_tree(path)  # the saved dataset's files, each opened by datasets
    else:
        size = require_regular(path).st_size
        if suffix not in TABLE_SUFFIXES:
            raise ConfigError(
                f"{{data}} {path}: an encoder-decoder trains on a table of source/target "
                f"pairs, one row an example: give a {_FORMATS}"
            )
        if size > 2 * MAX_TEXT_BYTES:
            raise ConfigError(
                f"{{data}} {path} is {format_bytes(size)}, more text than pipeswap tokenizes "
                f"in memory (at most {format_bytes(MAX_TEXT_BYTES)}); train on a part of it"
            )
    table = load_table(path, suffix)
    fields = list(table.column_names)
    missing = [
        f"{{{flag}}} {name!r}"
        for flag, name in (("source_field", source_field), ("target_field", target_field))
        if name not in fields
    ]
    if missing:
        raise ConfigError(
            f"{path} has no field {' and no field '.join(missing)} (its fields: "
            f"{', '.join(fields) or 'none'}); name the fields of the source and target text "
            "with {source_field} and {target_field}"
        )
    return _texts(table, path, source_field), _texts(table, path, target_field)


def _texts(table: Any, path: str, field: str) -> list[str]:
    values = list(table[field])
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise ConfigError(
                f"{path}: row {row} of field {field!r} holds {type(value).__name__}, not "
                "text; every example needs a source and a target text"
            )
    return values


def load_seq2seq_tokenizer(model: str) -> Any:
    """The tokenizer saved in the model directory ``model`` (local files only)."""
    if not os.path.isdir(model) or not any((Path(model) / f).is_file() for f in TOKENIZER_FILES):
        raise PipeswapError(
            f"{model} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): an encoder-decoder's "
            "source and target text are tokenized with the model's own; save it beside the "
            "model with tokenizer.save_pretrained(DIR)"
        )
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the user's files: say whose failure it is
        raise PipeswapError(
            f"cannot load the tokenizer in {model} ({first_line(exc)}); fix its tokenizer files"
        ) from None


def _padded(
    rows: Sequence[Sequence[int]], seq_len: int, fill: int, path: str, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """Token lists as a ``[N, seq_len]`` int64 array padded with ``fill``, and their lengths."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        raise ConfigError(
            f"{path}: the {what} of row {int(empty[0])} has no tokens; every example needs "
            "a source and a target text"
        )
    out = np.full((len(rows), seq_len), fill, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out, lengths


class PairDataset:
    """Tokenized source/target pairs: ``batch(b, index)`` returns ``(packed, labels)``,
    ``packed [b, 3, seq_len]`` (source ids, attention mask, labels:
    pipeswap.models.seq2seq) and ``labels [b, seq_len]`` (module docstring: order, splits)."""

    def __init__(
        self,
        sources: np.ndarray,
        source_lengths: np.ndarray,
        labels: np.ndarray,
        *,
        split: str = "train",
        seed: int = 0,
        where: str = "the data",
    ) -> None:
        rows = len(sources)
        if rows < (1 if split == "all" else 2):
            raise ConfigError(
                f"{where} has {rows} examples, too few for "
                + ("one" if split == "all" else "one to train on and one held out")
            )
        held = max(1, round(rows * HELD_OUT_FRACTION))
        first, count = {"train": (0, rows - held), "val": (rows - held, held), "all": (0, rows)}[
            split
        ]
        self.sources, self.source_lengths, self.labels = sources, source_lengths, labels
        self.split, self.first, self.count, self.seed = split, first, count, seed
        self.seq_len = sources.shape[1]
        self.order = EpochOrder(count, seed)

    def batch(self, batch_size: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size > self.count:
            raise ConfigError(
                f"the {self.split} split of the data has {self.count} examples, fewer than a "
                f"batch of {batch_size}; give more examples or lower {{batch}}"
            )
        chosen = (self.order.chosen(batch_size, index) + self.first).numpy()
        source = torch.from_numpy(self.sources[chosen])  # [b, L]
        mask = (
            torch.arange(self.seq_len)[None]
            < torch.from_numpy(self.source_lengths[chosen])[:, None]
        )
        labels = torch.from_numpy(self.labels[chosen])  # [b, L]
        packed = torch.empty(batch_size, ROWS, self.seq_len, dtype=torch.int64)
        packed[:, SOURCE], packed[:, MASK], packed[:, LABELS] = source, mask, labels
        return packed, labels.clone()


def tokenize_pairs(
    model: str,
    path: str,
    fields: tuple[str, str],
    seq_len: int,
    *,
    vocab_size: int,
    pad_token_id: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair of ``path`` tokenized with ``model``'s tokenizer: the sources padded with
    ``pad_token_id``, their lengths, and the labels padded with IGNORE_INDEX, each cut at
    ``seq_len`` tokens."""
    if seq_len < 1:
        raise ConfigError(f"{{seq_len}} must be at least 1, not {seq_len}")
    sources, targets = read_pairs(path, *fields)
    tokenizer = load_seq2seq_tokenizer(model)
    cut = {"truncation": True, "max_length": seq_len}
    source_ids = tokenizer(sources, **cut)["input_ids"] if sources else []
    target_ids = tokenizer(text_target=targets, **cut)["input_ids"] if targets else []
    source, lengths = _padded(source_ids, seq_len, pad_token_id, path, "source")
    labels, _ = _padded(target_ids, seq_len, IGNORE_INDEX, path, "target")
    highest = max(int(source.max(initial=0)), int(labels.max(initial=0)))
    if highest >= vocab_size:
        raise PipeswapError(
            f"the tokenizer in {model} gives token {highest}, outside the model's vocabulary "
            f"of {vocab_size}; save the model's own tokenizer beside it"
        )
    return source, lengths, labels
