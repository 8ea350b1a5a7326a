"""pipeswap/user_data.py: a user's own tokens and text as language-modelling batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeswap.cli import main
from pipeswap.config_fields import ConfigError
from pipeswap.data import MaskedLMDataset, dataset_for
from pipeswap.data_config import DataConfig, UserData
from pipeswap.errors import PipeswapError
from pipeswap.user_data import TextDataset, read_tokens

DOCS = [f"document {i}: " + "abc xyz " * (20 + i) for i in range(30)]


def _corpus(folder: Path) -> dict[str, Path]:
    """The same documents as JSON lines, a text file, a folder of text files and tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": folder / "c.jsonl", "txt": folder / "c.txt", "bin": folder / "c.bin"}
    paths["jsonl"].write_text("".join(json.dumps({"text": d, "n": 1}) + "\n" for d in DOCS))
    paths["txt"].write_text("\n".join(DOCS))
    np.frombuffer("\n".join(DOCS).encode(), dtype=np.uint8).astype(np.uint16).tofile(paths["bin"])
    (folder / "dir").mkdir()
    for i, doc in enumerate(DOCS):
        (folder / "dir" / f"{i:03d}.txt").write_text(doc)
    paths["dir"] = folder / "dir"
    return paths


def test_every_source_gives_the_same_byte_tokens(tmp_path: Path) -> None:
    paths = _corpus(tmp_path)
    expected = np.frombuffer("\n".join(DOCS).encode(), dtype=np.uint8)
    for kind, path in paths.items():
        tokens = read_tokens(str(path), "text", None)
        assert np.array_equal(np.asarray(tokens), expected), kind
    assert isinstance(read_tokens(str(paths["bin"]), "text", None), np.memmap)  # not read in
    npy = tmp_path / "c.npy"
    np.save(npy, expected.astype(np.int32))
    assert np.array_equal(read_tokens(str(npy), "text", None), expected)
    csv = tmp_path / "c.csv"
    csv.write_text("text,n\n" + "".join(f'"{d}",1\n' for d in DOCS))
    assert np.array_equal(read_tokens(str(csv), "text", None), expected)


def test_a_saved_dataset_directory_reads_like_its_file(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "saved"))
    tokens = read_tokens(str(tmp_path / "saved"), "body", None)
    assert bytes(np.asarray(tokens, dtype=np.uint8)) == "\n".join(DOCS).encode()


def test_an_epoch_visits_every_training_window_once_and_ranks_are_disjoint() -> None:
    tokens = np.arange(2000)  # window w starts with token 8 w: a window is its first token
    data = TextDataset(tokens, 7, vocab_size=10**6, seed=3)
    per_epoch = data.count // 4
    starts = [s for i in range(per_epoch) for s in data.batch(4, i)[0][:, 0].tolist()]
    assert len(starts) == len(set(starts)) == per_epoch * 4  # no window twice in an epoch
    assert set(starts) <= {8 * w for w in range(data.count)}  # training windows only
    assert data.count - len(starts) < 4  # only a partial batch's worth left out
    # Two data-parallel ranks take consecutive indexes: disjoint windows.
    rank0 = {tuple(r) for r in data.batch(4, 0)[0].tolist()}
    rank1 = {tuple(r) for r in data.batch(4, 1)[0].tolist()}
    assert not rank0 & rank1
    # Targets are the inputs shifted by one; the same seed gives the same batches.
    x, y = data.batch(4, 5)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(TextDataset(tokens, 7, vocab_size=10**6, seed=3).batch(4, 5)[0], x)
    # Another epoch visits them in another order.
    assert not torch.equal(data.batch(4, per_epoch)[0], data.batch(4, 0)[0])


def test_the_held_out_split_is_the_last_windows_and_never_trained_on() -> None:
    tokens = np.arange(9 * 100)
    train = TextDataset(tokens, 8, vocab_size=10**6, split="train")
    val = TextDataset(tokens, 8, vocab_size=10**6, split="val")
    assert (train.count, val.count) == (95, 5)
    held = {int(val.batch(5, 0)[0][i, 0]) for i in range(5)}
    trained = {int(train.batch(5, i)[0][j, 0]) for i in range(19) for j in range(5)}
    assert held == {w * 9 for w in range(95, 100)} and not held & trained


def test_bad_data_is_refused_naming_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PipeswapError, match="holds no tokens"):
        dataset_for(
            "gpt2-micro", seq_len=8, data=UserData(str(tmp_path / "empty.txt"), "text", "train")
        )
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ConfigError, match="3 tokens, too few for two windows"):
        dataset_for(
            "gpt2-micro", seq_len=8, data=UserData(str(tmp_path / "short.txt"), "text", "train")
        )
    big = tmp_path / "big.npy"
    np.save(big, np.array([1, 2, 300] + [5] * 100))
    with pytest.raises(
        PipeswapError, match="token 300 at position 2 is outside the model's vocabulary of 256"
    ):
        dataset_for("gpt2-micro", seq_len=8, data=UserData(str(big), "text", "train"))
    paths = _corpus(tmp_path / "c")
    with pytest.raises(ConfigError, match=r"has no field 'body' \(its fields: text, n\)"):
        read_tokens(str(paths["jsonl"]), "body", None)
    with pytest.raises(ConfigError, match="does not exist"):
        read_tokens(str(tmp_path / "nope.jsonl"), "text", None)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(PipeswapError, match="no whole uint16 tokens"):
        read_tokens(str(tmp_path / "odd.bin"), "text", None)
    with pytest.raises(ConfigError, match="image model"):
        dataset_for("resnet-micro", data=UserData(str(paths["bin"]), "text", "train"))


@pytest.mark.parametrize(
    "second,why",
    [
        ("{broken", "line 2: not JSON (Expecting property name"),
        ('["a list"]', "line 2: a JSON list"),
    ],
)
def test_a_broken_json_lines_file_names_its_line_and_the_library_says_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], second: str, why: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' + second + "\n")
    with pytest.raises(PipeswapError, match="each line of a .jsonl file is one JSON object") as e:
        read_tokens(str(bad), "text", None)
    assert f"{bad}, {why}" in str(e.value)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""  # datasets' own log line stays quiet


def test_a_masked_model_gets_masked_batches_of_the_user_s_text(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.models.hf_configs import save_config

    paths = _corpus(tmp_path)
    bert = save_config(tmp_path / "bert", "bert")  # a masked LM (its config's mask token)
    data = dataset_for(bert, seq_len=16, data=UserData(str(paths["txt"]), "text", "train"))
    assert isinstance(data, MaskedLMDataset)
    inputs, targets = data.batch(4, 0)
    assert inputs.shape == targets.shape == (4, 16)
    masked = targets != -100
    assert bool((inputs[masked] == data.mask_token_id).all()) and 0 < int(masked.sum()) < 64


@pytest.mark.parametrize(
    "mode",
    [[], pytest.param(["--nproc", "2"], marks=pytest.mark.slow), ["--pipeline", "2", "--emulate"]],
)
def test_train_on_your_data_in_every_mode(tmp_path: Path, mode: list[str]) -> None:
    paths = _corpus(tmp_path / "c")
    reports = {}
    for kind in ("jsonl", "bin"):
        report = tmp_path / f"{kind}.json"
        argv = ["train", "--model", "gpt2-micro", "--seq-len", "16", "--batch", "4"]
        argv += ["--steps", "6", "--data", str(paths[kind]), "--report", str(report), *mode]
        assert main(argv) == 0
        reports[kind] = json.loads(report.read_text())
    # The same bytes as text or as tokens train identically; unlike the built-in data.
    assert reports["jsonl"]["params_sha256"] == reports["bin"]["params_sha256"]
    builtin = tmp_path / "builtin.json"
    argv = ["train", "--model", "gpt2-micro", "--seq-len", "16", "--batch", "4", "--steps", "6"]
    assert main([*argv, "--report", str(builtin), *mode]) == 0
    assert json.loads(builtin.read_text())["losses"] != reports["bin"]["losses"]


def test_a_held_out_file_of_its_own_is_scored_whole_and_all_of_data_trains() -> None:
    config = DataConfig(data="train.bin", eval_data="held.bin")
    assert config.source("train") == UserData("train.bin", "text", "all")
    assert config.source("val") == UserData("held.bin", "text", "all")
    assert DataConfig(data="t.bin").source("val") == UserData("t.bin", "text", "val")
    assert DataConfig().source("train") is None
    tokens = np.arange(10 * 17, dtype=np.uint16) % 250
    whole = TextDataset(tokens, 16, vocab_size=256, split="all")
    assert (whole.first, whole.count) == (0, 10)
    one = TextDataset(tokens[:17], 16, vocab_size=256, split="all")  # one window is enough
    assert one.count == 1
    with pytest.raises(ConfigError, match="give data PATH too"):
        DataConfig(eval_data="held.bin")
    with pytest.raises(ConfigError, match="eval_batches is -1"):
        DataConfig(eval_batches=-1)


def _bert_with_tokenizer(directory: Path, *, mask: bool) -> str:
    """A BERT masked-LM config (no mask_token_id, as bert-base-uncased's) and a word-level
    tokenizer of its own, whose [MASK] is id 4 (or which has no mask token)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import save_config

    path = save_config(directory, "bert")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w for d in DOCS for w in d.split()})
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    named = {"pad_token": "[PAD]", "unk_token": "[UNK]", "sep_token": "[SEP]"}
    if mask:
        named["mask_token"] = "[MASK]"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **named).save_pretrained(path)
    return path


def test_a_masked_model_with_its_own_tokenizer_masks_with_the_tokenizer_s_mask(
    tmp_path: Path,
) -> None:
    """BERT's config carries no mask token; its tokenizer does, and it tokenizes the text:
    a masked token is [MASK], never an ordinary id past the byte range."""
    paths = _corpus(tmp_path)
    bert = _bert_with_tokenizer(tmp_path / "bert", mask=True)
    data = dataset_for(bert, seq_len=16, data=UserData(str(paths["txt"]), "text", "train"))
    assert isinstance(data, MaskedLMDataset) and data.mask_token_id == 4
    inputs, targets = data.batch(4, 0)
    assert bool((inputs[targets != -100] == 4).all())
    bare = _bert_with_tokenizer(tmp_path / "bare", mask=False)
    with pytest.raises(PipeswapError, match="has no mask token"):
        dataset_for(bare, seq_len=16, data=UserData(str(paths["txt"]), "text", "train"))
