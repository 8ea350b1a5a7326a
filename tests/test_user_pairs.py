"""A user's source/target pairs: every table format, padding and masks, splits, refusals.

Covers: pipeswap/user_pairs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.user_pairs import PairDataset, read_pairs, tokenize_pairs
from tests.models.seq2seq_dirs import pair_rows, save_seq2seq, write_jsonl

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_seq2seq(tmp_path_factory.mktemp("t5") / "t5", "t5")


def test_json_lines_csv_and_parquet_hold_the_same_pairs(tmp_path: Path) -> None:
    rows = pair_rows(12)
    table = datasets.Dataset.from_list(rows)
    table.to_csv(tmp_path / "p.csv", index=False)
    table.to_parquet(tmp_path / "p.parquet")
    files = [write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "p.csv", tmp_path / "p.parquet"]
    want = ([r["question"] for r in rows], [r["answer"] for r in rows])
    for path in files:
        assert read_pairs(str(path), "question", "answer") == want, path


def test_sources_are_padded_and_masked_targets_padded_with_ignore_index(
    tmp_path: Path, t5: str
) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "w1 w2", "a": "w3"}, {"q": "w4", "a": "w5 w6"}])
    source, lengths, labels = tokenize_pairs(t5, path, ("q", "a"), 4, vocab_size=27, pad_token_id=0)
    # T5's tokenizer ends each text with </s> (id 1); words are ids 3 and up.
    assert source.tolist() == [[4, 5, 1, 0], [7, 1, 0, 0]]
    assert lengths.tolist() == [3, 2]
    assert labels.tolist() == [[6, 1, -100, -100], [8, 9, 1, -100]]
    data = PairDataset(source, lengths, labels, split="all")
    packed, targets = data.batch(2, 0)
    assert packed.shape == (2, 3, 4) and packed.dtype == torch.int64
    for row in range(2):  # whichever order the epoch drew
        k = int(np.flatnonzero((source == packed[row, 0].numpy()).all(1))[0])
        assert packed[row, 1].tolist() == [1] * int(lengths[k]) + [0] * (4 - int(lengths[k]))
        assert torch.equal(packed[row, 2], targets[row])
        assert targets[row].tolist() == labels[k].tolist()
    # Cut at seq_len: the tokenizer truncates (its </s> kept last, as T5's does).
    long = write_jsonl(tmp_path / "l.jsonl", [{"q": " ".join(["w1"] * 9), "a": "w2"}] * 2)
    cut, _, _ = tokenize_pairs(t5, long, ("q", "a"), 4, vocab_size=27, pad_token_id=0)
    assert cut.shape == (2, 4) and (cut != 0).all()


def test_the_last_five_percent_are_held_out_and_batches_repeat() -> None:
    rows = 40
    source = np.arange(rows, dtype=np.int64)[:, None].repeat(3, 1)
    lengths = np.full(rows, 3)
    labels = source.copy()
    train = PairDataset(source, lengths, labels, split="train", seed=1)
    val = PairDataset(source, lengths, labels, split="val", seed=1)
    seen = {int(x) for i in range(19) for x in train.batch(2, i)[0][:, 0, 0]}
    assert seen == set(range(38))  # an epoch visits every training row once
    assert {int(x) for x in val.batch(2, 0)[0][:, 0, 0]} == {38, 39}
    assert torch.equal(train.batch(2, 5)[0], train.batch(2, 5)[0])
    assert labels[:, 0].tolist() == list(range(rows))  # batches are copies
    with pytest.raises(ConfigError, match="fewer than a batch of 4"):
        val.batch(4, 0)


def test_what_cannot_be_a_pair_is_refused(tmp_path: Path, t5: str) -> None:
    good = write_jsonl(tmp_path / "p.jsonl", pair_rows(4))
    with pytest.raises(ConfigError, match="no field target_field 'label'"):
        read_pairs(good, "question", "label")
    with pytest.raises(ConfigError, match="give a .jsonl, .csv"):
        (tmp_path / "p.txt").write_text("w1 w2\n")
        read_pairs(str(tmp_path / "p.txt"), "question", "answer")
    with pytest.raises(ConfigError, match="does not exist"):
        read_pairs(str(tmp_path / "none.jsonl"), "question", "answer")
    numbers = tmp_path / "n.jsonl"
    numbers.write_text(json.dumps({"question": "w1", "answer": 3}) + "\n")
    with pytest.raises(ConfigError, match="row 0 of field 'answer' holds int"):
        read_pairs(str(numbers), "question", "answer")
    empty = write_jsonl(tmp_path / "e.jsonl", [{"q": "w1", "a": "w2"}, {"q": "w1", "a": ""}])
    t5_without_eos = save_seq2seq(tmp_path / "t5b", "t5")
    with pytest.raises(ConfigError, match="the target of row 1 has no tokens"):
        _no_template(t5_without_eos)
        tokenize_pairs(t5_without_eos, empty, ("q", "a"), 4, vocab_size=27, pad_token_id=0)
    with pytest.raises(PipeswapError, match="outside the model's vocabulary of 5"):
        tokenize_pairs(t5, good, ("question", "answer"), 4, vocab_size=5, pad_token_id=0)
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(PipeswapError, match="holds no tokenizer"):
        tokenize_pairs(str(bare), good, ("question", "answer"), 4, vocab_size=27, pad_token_id=0)


def _no_template(directory: str) -> None:
    """Drop the tokenizer's template: an empty text then tokenizes to nothing at all."""
    path = Path(directory) / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["post_processor"] = None
    path.write_text(json.dumps(spec))
