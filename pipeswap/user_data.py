"""A user's own text or token files as language-modelling batches, read offline.

Sources, by what the path is:

- ``.bin`` (uint16 tokens, as nanoGPT writes them) and ``.npy`` (any integer dtype):
  memory-mapped, so a corpus larger than memory trains in constant memory;
- ``.txt`` or a directory of ``.txt`` files, JSON lines (``.jsonl``/``.json``),
  ``.csv``, ``.parquet``, ``.arrow``, or a directory a Hugging Face ``datasets`` object
  was saved to with ``save_to_disk``: read with Hugging Face ``datasets`` (offline), the
  text in field ``text_field``, tokenized with the model directory's own tokenizer when
  it has one (local files only), byte-level (UTF-8 bytes) otherwise; documents are
  joined with the tokenizer's end-of-text token (a newline, byte-level).

Only regular files are read (pipeswap.user_files: a device, FIFO or socket is refused
before it is opened), text up to a bound, and a ``.npy`` only as a literal integer array.

The tokens are cut into non-overlapping windows of ``seq_len + 1``; the last 5% of the
windows (at least one) are the held-out split (part ``val``, the rest part ``train``),
unless the held-out data is a file of its own (then each file is used whole, part
``all``). Each epoch visits the training windows in an order drawn from ``(seed,
epoch)`` (:class:`EpochOrder`, a keyed permutation that stores nothing per window);
windows are read with ordinary reads, so a corpus of any size trains in constant
memory. Batch ``index`` of the run is windows
``index * b`` to ``index * b + b - 1`` of that order (data-parallel ranks take
consecutive indexes, so they see disjoint windows and every window once per epoch).
Windows left over at the end of an epoch that do not fill a batch are skipped that
epoch (another order brings them in the next).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError, first_line
from pipeswap.progress import thread_lock_for_bars
from pipeswap.units import format_bytes
from pipeswap.user_files import (
    MAX_TEXT_BYTES,
    TextStats,
    check_tree,
    map_npy,
    open_regular,
    read_text,
    require_regular,
)

__all__ = [
    "HELD_OUT_FRACTION",
    "TABLE_SUFFIXES",
    "TOKENIZER_FILES",
    "Encode",
    "EpochOrder",
    "TextDataset",
    "load_table",
    "load_tokenizer",
    "read_tokens",
    "tokenizer_mask_id",
]

HELD_OUT_FRACTION = 0.05
_TABLES = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
# The table files datasets reads, by suffix (a save_to_disk directory is the other table).
TABLE_SUFFIXES = frozenset(_TABLES)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

Encode = Callable[[str], list[int]]


def load_tokenizer(model: str) -> tuple[Encode, int] | None:
    """The encoder and end-of-text id of the model directory's own tokenizer, or None
    when ``model`` is no directory holding one (then text is tokenized byte by byte)."""
    if not os.path.isdir(model) or not any((Path(model) / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the user's files: say whose failure it is
        raise PipeswapError(
            f"cannot load the tokenizer in {model} ({first_line(exc)}); fix or remove its "
            "tokenizer files (text is then tokenized byte by byte)"
        ) from None
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if eos is None:
        raise PipeswapError(
            f"the tokenizer in {model} has no end-of-text token to join documents: set "
            '"eos_token" in its tokenizer_config.json (a token its vocabulary has), or remove '
            "its tokenizer files (text is then tokenized byte by byte)"
        )
    return (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]), int(eos)


def tokenizer_mask_id(model: str) -> int | None:
    """The mask token id of the model directory's own tokenizer, which tokenizes the
    user's text (None where it has no tokenizer: text is then bytes, masked with pipeswap's
    id); refused when that tokenizer has no mask token for a masked LM to fill."""
    if load_tokenizer(model) is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if tokenizer.mask_token_id is None:
        raise PipeswapError(
            f"the tokenizer in {model} has no mask token, which a masked language model "
            "replaces the chosen tokens with: set its mask_token (tokenizer.add_special_tokens"
            "({'mask_token': '[MASK]'}) and save_pretrained)"
        )
    return int(tokenizer.mask_token_id)


def read_tokens(path: str, text_field: str, tokenizer: tuple[Encode, int] | None) -> np.ndarray:
    """Every token of ``path`` as a 1-D integer array (memory-mapped for token files)."""
    if not os.path.lexists(path):
        raise ConfigError(f"{{data}} {path} does not exist; give a token, text or table file")
    size = 0 if os.path.isdir(path) else require_regular(path).st_size
    suffix = Path(path).suffix.lower()
    if suffix == ".bin" and not os.path.isdir(path):
        if size % 2:
            raise PipeswapError(f"{path}: {size} bytes is no whole uint16 tokens")
        return np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
    if suffix == ".npy" and not os.path.isdir(path):
        return map_npy(path)
    stats = TextStats()
    pieces: list[np.ndarray] = []
    for document in _documents(path, suffix, text_field, stats):
        if pieces:
            pieces.append(np.array([ord("\n") if tokenizer is None else tokenizer[1]]))
        if tokenizer is None:  # byte-level: the UTF-8 bytes are the tokens
            pieces.append(np.frombuffer(document.encode("utf-8"), dtype=np.uint8))
        else:
            pieces.append(np.asarray(tokenizer[0](document), dtype=np.int64))
    note = stats.note()
    if note is not None:
        warnings.warn(f"{path}: {note}", UnicodeWarning, stacklevel=2)
    dtype = np.uint8 if tokenizer is None else np.int64
    return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)


def _documents(path: str, suffix: str, text_field: str, stats: TextStats) -> Iterator[str]:
    if os.path.isdir(path) and not (Path(path) / "dataset_info.json").is_file():
        files = sorted(Path(path).rglob("*.txt"))
        if not files:
            raise ConfigError(
                f"{{data}} {path} is a directory with no .txt files and no saved dataset; "
                "give a file, a folder of .txt files or a save_to_disk directory"
            )
        check_tree(path, files)  # a FIFO among them would block the read of the folder
        for file in files:
            yield read_text(file, stats)
        return
    if suffix == ".txt":
        yield read_text(path, stats)
        return
    if not os.path.isdir(path) and suffix not in _TABLES:
        raise ConfigError(
            f"{{data}} {path}: pipeswap reads .bin/.npy tokens, .txt, .jsonl, .csv, .parquet "
            "and .arrow files, folders of .txt files and save_to_disk directories"
        )
    if os.path.isdir(path):
        check_tree(path)  # the saved dataset's files, each opened by datasets
    elif os.path.getsize(path) > 2 * MAX_TEXT_BYTES:
        raise ConfigError(
            f"{{data}} {path} is {format_bytes(os.path.getsize(path))}, more text than pipeswap "
            f"tokenizes in memory (at most {format_bytes(MAX_TEXT_BYTES)}); tokenize a larger "
            "corpus once into a .bin file of uint16 tokens (memory-mapped, any size)"
        )
    for text in _table_texts(path, suffix, text_field):
        stats.count(len(text), path)
        yield text


def _table_texts(path: str, suffix: str, text_field: str) -> Iterator[str]:
    table = load_table(path, suffix)
    if text_field not in table.column_names:
        raise ConfigError(
            f"{path} has no field {text_field!r} (its fields: {', '.join(table.column_names)}); "
            "name the text's field with {text_field}"
        )
    for value in table[text_field]:
        if not isinstance(value, str):
            raise PipeswapError(
                f"{path}: field {text_field!r} holds {type(value).__name__}, not text"
            )
        yield value


def load_table(path: str, suffix: str) -> Any:
    """The rows of a table file (JSON lines, CSV, Parquet, Arrow; ``suffix`` says which) or
    of a ``save_to_disk`` directory, read offline with Hugging Face ``datasets``."""
    thread_lock_for_bars()  # before datasets builds tqdm's process-shared lock (see there)
    try:
        import datasets
    except ImportError:
        raise PipeswapError(
            f"reading {path} needs the datasets package: pip install 'pipeswap[hf]'"
        ) from None
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    # Its own account of a bad file (an ERROR log line) would reach stderr: ours names the line.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        if os.path.isdir(path):
            table = datasets.load_from_disk(path)
            if isinstance(table, datasets.DatasetDict):
                table = table["train"] if "train" in table else next(iter(table.values()))
        else:
            table = datasets.load_dataset(_TABLES[suffix], data_files=path, split="train")
    except Exception as exc:  # noqa: BLE001 - the user's file: say whose failure it is
        bad = _bad_json_line(path) if suffix == ".jsonl" else None
        raise PipeswapError(bad or f"cannot read {path} ({first_line(exc)})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    return table


def _bad_json_line(path: str) -> str | None:
    """Where a JSON-lines file first breaks its format, and what a line must be."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                why = f"not JSON ({exc.msg} at column {exc.colno})"
            else:
                if isinstance(row, dict):
                    continue
                why = f"a JSON {type(row).__name__}, not an object"
            return (
                f"{path}, line {number}: {why}; each line of a .jsonl file is one JSON object, "
                'such as {"text": "..."}'
            )
    return None


def _read(tokens: np.ndarray, start: int, count: int) -> np.ndarray:
    """``tokens[start : start + count]``; from a memory-mapped file through an ordinary
    read, so no page of the file stays resident in this process (a page fault on the map
    would also read ahead megabytes around a scattered window). A file that shrank since
    it was mapped (a short read) is refused, never trained on."""
    if isinstance(tokens, np.memmap) and tokens.filename is not None:
        offset = tokens.offset + start * tokens.dtype.itemsize
        with open_regular(tokens.filename) as handle:
            part = np.fromfile(handle, dtype=tokens.dtype, count=count, offset=offset)
            size = os.fstat(handle.fileno()).st_size
        if len(part) != count:
            raise PipeswapError(
                f"{tokens.filename} changed while pipeswap read it: it is {size:,} bytes now, "
                f"{tokens.offset + tokens.nbytes:,} when the run began; leave data files as "
                "they are during a run, and start it again"
            )
        return part
    return np.asarray(tokens[start : start + count])


def _outside_vocabulary(tokens: np.ndarray, vocab_size: int) -> int | None:
    """The position of the first token outside ``[0, vocab_size)``, or None, read in
    chunks (a corpus larger than memory is checked in constant memory)."""
    chunk = 1 << 22
    for start in range(0, len(tokens), chunk):
        part = _read(tokens, start, min(chunk, len(tokens) - start))
        wrong = (part < 0) | (part >= vocab_size)
        if wrong.any():
            return start + int(np.argmax(wrong))
    return None


class EpochOrder:
    """Which items batch ``index`` of a run takes: each epoch visits the ``count`` items in
    an order drawn from ``(seed, epoch)``, batch after batch; items left over at the end of
    an epoch that do not fill a batch wait for another epoch's order.

    The order is a keyed permutation computed per position (three rounds of an odd
    multiply, an xor-shift and an add on ``bits``-bit integers, each a bijection, walked
    until it lands below ``count``), so it costs no memory per item: a corpus of any size
    is shuffled in constant memory.
    """

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed = count, seed
        self.bits = max(2, (count - 1).bit_length())
        self._keys: tuple[int, list[tuple[int, int]]] | None = None

    def _rounds(self, epoch: int) -> list[tuple[int, int]]:
        if self._keys is None or self._keys[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            drawn = torch.randint(0, 2**self.bits, (6,), generator=gen).tolist()
            self._keys = (epoch, [(a | 1, b) for a, b in zip(drawn[::2], drawn[1::2])])
        return self._keys[1]

    def _permute(self, values: torch.Tensor, rounds: list[tuple[int, int]]) -> torch.Tensor:
        mask, shift = (1 << self.bits) - 1, max(1, self.bits // 2)
        for multiplier, offset in rounds:
            values = (values * multiplier) & mask
            values = values ^ (values >> shift)
            values = (values + offset) & mask
        return values

    def chosen(self, batch_size: int, index: int) -> torch.Tensor:
        epoch, batch_in_epoch = divmod(index, self.count // batch_size)
        rounds = self._rounds(epoch)
        positions = torch.arange(
            batch_in_epoch * batch_size, (batch_in_epoch + 1) * batch_size, dtype=torch.int64
        )
        values = self._permute(positions, rounds)
        while bool((outside := values >= self.count).any()):
            values[outside] = self._permute(values[outside], rounds)
        return values


class TextDataset:
    """Windows of a user's tokens: ``batch(b, index)`` returns ``(tokens, targets)``, both
    ``[b, seq_len]`` int64, targets shifted by one (module docstring: order and splits)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        vocab_size: int,
        split: str = "train",
        seed: int = 0,
        where: str = "the data",
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"{{seq_len}} must be at least 1, not {seq_len}")
        windows = len(tokens) // (seq_len + 1)
        if len(tokens) == 0:
            raise PipeswapError(f"{where} holds no tokens; give a file with text or tokens")
        if windows < (1 if split == "all" else 2):
            raise ConfigError(
                f"{where} has {len(tokens)} tokens, too few for "
                + ("a window" if split == "all" else "two windows (one to train on, one held out)")
                + f" of {{seq_len}} {seq_len} plus one; lower {{seq_len}}"
            )
        bad = _outside_vocabulary(tokens, vocab_size)
        if bad is not None:
            raise PipeswapError(
                f"{where}: token {int(tokens[bad])} at position {bad} is outside the model's "
                f"vocabulary of {vocab_size}; tokenize with the model's own tokenizer"
            )
        held = max(1, round(windows * HELD_OUT_FRACTION))
        first, count = {
            "train": (0, windows - held),
            "val": (windows - held, held),
            "all": (0, windows),
        }[split]
        self.tokens, self.seq_len, self.split, self.seed = tokens, seq_len, split, seed
        self.vocab_size, self.where = vocab_size, where
        self.first, self.count = first, count
        self.order = EpochOrder(count, seed)

    def batch(self, batch_size: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size > self.count:
            raise ConfigError(
                f"the {self.split} split of the data has {self.count} windows of {{seq_len}} "
                f"{self.seq_len}, fewer than a batch of {batch_size}; give more data or lower "
                "{batch}"
            )
        chosen = self.order.chosen(batch_size, index)
        width = self.seq_len + 1
        rows = [_read(self.tokens, (self.first + int(w)) * width, width) for w in chosen]
        window = torch.from_numpy(np.stack(rows).astype(np.int64))
        if bool(((window < 0) | (window >= self.vocab_size)).any()):  # checked when opened
            raise PipeswapError(
                f"{self.where} changed while pipeswap read it: it now holds tokens outside "
                f"the model's vocabulary of {self.vocab_size}; leave data files as they are "
                "during a run, and start it again"
            )
        return window[:, :-1], window[:, 1:]
