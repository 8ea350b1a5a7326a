"""Encoder-decoders from the CLI: `pipeswap train --model DIR --data PAIRS --source-field --target-field`.

Covers pipeswap/models/seq2seq.py, pipeswap/training/seq2seq_job.py and the CLI's refusals:
a tiny T5 trains on JSON lines with swapping, bit-identical to training without it, its
``--save`` reloads with ``AutoModelForSeq2SeqLM`` and scores the report's held-out loss;
BART trains on CSV; two gloo ranks swap as one; what cannot work is refused with exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeswap.cli import main
from pipeswap.data_config import DataConfig
from pipeswap.training.report import load_report
from pipeswap.training.seq2seq_job import Seq2SeqJob
from tests.models.hf_configs import save_config
from tests.models.seq2seq_dirs import pair_rows, save_seq2seq, write_jsonl

transformers = pytest.importorskip("transformers")

_FIELDS = ["--source-field", "question", "--target-field", "answer"]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seq2seq")
    return {
        "t5": save_seq2seq(root / "t5", "t5"),
        "bart": save_seq2seq(root / "bart", "bart"),
        "pairs": write_jsonl(root / "pairs.jsonl", pair_rows(120)),
    }


def _train(tmp_path: Path, name: str, model: str, *argv: str) -> dict[str, Any]:
    report = tmp_path / f"{name}.json"
    argv = ("--device", "cpu", "--seq-len", "8", "--batch", "4", "--report", str(report), *argv)
    assert main(["train", "--model", model, *argv]) == 0
    return load_report(report).to_json()


def test_t5_trains_on_json_lines_saves_and_reloads_to_the_reports_held_out_loss(
    tmp_path: Path, made: dict[str, str]
) -> None:
    out = tmp_path / "trained"
    data = ["--data", made["pairs"], *_FIELDS, "--eval-batches", "2"]
    swapped = _train(
        tmp_path,
        "swap",
        made["t5"],
        *data,
        "--steps",
        "3",
        "--swap-policy",
        "disjoint",
        "--footprint-ratio",
        "1.3",
        "--save",
        str(out),
    )
    assert swapped["swapped_bytes"][0] > 0
    layers = swapped["plan"]["layers"]
    assert layers[0] == "model.encoder.block.0" and layers[-1] == "model.decoder.block.1"
    stated = swapped["eval"]
    assert stated["batches"] == 2
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out, local_files_only=True).eval()
    assert type(model).__name__ == "T5ForConditionalGeneration"
    # The held-out pairs as the run read them (the last 5% of the rows, in the run's order).
    job = Seq2SeqJob(made["t5"], 4, 8, data=DataConfig(data=made["pairs"], **_fields()))
    losses = []
    with torch.no_grad():
        for index in range(2):
            packed, labels = job.batch(index, "val")
            assert bool((labels == -100).any())  # padded targets: the loss skips them
            output = model(input_ids=packed[:, 0], attention_mask=packed[:, 1], labels=labels)
            losses.append(float(output.loss))
    assert abs(sum(losses) / 2 - stated["loss"]) <= 1e-6


def _fields() -> dict[str, str]:
    return {"source_field": "question", "target_field": "answer"}


def test_swapping_t5_and_bart_changes_no_bit(tmp_path: Path, made: dict[str, str]) -> None:
    """BART from CSV: every format the LM path reads holds pairs too."""
    csv = tmp_path / "pairs.csv"
    pytest.importorskip("datasets").Dataset.from_list(pair_rows(120)).to_csv(csv, index=False)
    for family, data, ratio in (("t5", made["pairs"], "1.3"), ("bart", str(csv), "1.1")):
        common = ["--steps", "2", "--data", data, *_FIELDS, "--eval-batches", "0"]
        swapped = _train(
            tmp_path, "s", made[family], *common, "--swap-policy", "disjoint",
            "--footprint-ratio", ratio,
        )  # fmt: skip
        plain = _train(tmp_path, "p", made[family], *common, "--swap-policy", "none")
        assert swapped["swapped_bytes"][0] > 0, family
        assert swapped["losses"] == plain["losses"], family
        assert swapped["params_sha256"] == plain["params_sha256"], family


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_swapped_equal_two_ranks_plain(tmp_path: Path, made: dict[str, str]) -> None:
    common = ["--steps", "2", "--nproc", "2", "--data", made["pairs"], *_FIELDS]
    swapped = _train(
        tmp_path, "s", made["t5"], *common, "--swap-policy", "disjoint", "--footprint-ratio", "1.2"
    )
    plain = _train(tmp_path, "p", made["t5"], *common, "--swap-policy", "none")
    assert all(b > 0 for b in swapped["swapped_bytes"])
    assert swapped["losses_per_rank"] == plain["losses_per_rank"]
    assert swapped["params_sha256"] == plain["params_sha256"]
    assert swapped["eval"] == plain["eval"] and swapped["eval"]["batches"] == 4


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["train", "--device", "cpu", "--seq-len", "8", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    return err


def test_refusals_say_what_to_write(
    tmp_path: Path, made: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    t5, pairs = ["--model", made["t5"]], made["pairs"]
    err = _refused(capsys, [*t5, "--data", pairs, "--source-field", "prompt", "--target-field", "answer"])  # fmt: skip
    assert "no field --source-field 'prompt'" in err and "question, answer" in err
    err = _refused(capsys, [*t5, "--data", pairs])
    assert "encoder-decoder" in err and "--source-field" in err and "--target-field" in err
    err = _refused(capsys, [*t5])
    assert "--data FILE" in err
    err = _refused(capsys, [*t5, "--data", pairs, *_FIELDS, "--pipeline", "2", "--emulate"])
    assert "drop --pipeline" in err and "pipeswap.offload" in err
    err = _refused(capsys, [*t5, "--data", pairs, "--source-field", "question"])
    assert "--source-field and --target-field go together" in err
    text = tmp_path / "corpus.txt"
    text.write_text("w1 w2 w3\n" * 50)
    err = _refused(capsys, [*t5, "--data", str(text), *_FIELDS])
    assert ".jsonl, .csv, .parquet" in err
    gpt2 = save_config(tmp_path / "gpt2", "gpt2")
    err = _refused(capsys, ["--model", gpt2, "--data", pairs, *_FIELDS])
    assert "encoder-decoder models (T5, BART)" in err and "drop them" in err


def test_a_resumed_run_ends_as_one_left_alone_and_its_checkpoint_exports(
    tmp_path: Path, made: dict[str, str]
) -> None:
    # A constant rate: the default decays over the run's steps, which a resume changes.
    common = ["--data", made["pairs"], *_FIELDS, "--eval-batches", "1", "--optimizer", "adamw"]
    ckpt = str(tmp_path / "ckpt")
    whole = _train(tmp_path, "whole", made["t5"], *common, "--steps", "3")
    _train(tmp_path, "first", made["t5"], *common, "--steps", "2", "--checkpoint-dir", ckpt)
    resumed = _train(tmp_path, "resumed", made["t5"], *common, "--steps", "3", "--resume", ckpt)
    assert resumed["losses"] == whole["losses"]
    assert resumed["params_sha256"] == whole["params_sha256"]
    out = tmp_path / "exported"
    assert main(["export", ckpt, "--model", made["t5"], "--out", str(out)]) == 0
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "T5ForConditionalGeneration"


def _uneven_pairs(tmp_path: Path) -> tuple[str, str, list[float], float]:
    """A T5 without dropout, pairs whose answers run 1 to 4 times as long, and a plain
    loop's losses over 2 steps of 8 pairs (one loss over the whole batch, SGD at 0.5), with
    the plain mean of the first step's two halves' losses beside them."""
    t5 = save_seq2seq(tmp_path / "t5", "t5", dropout=0.0)
    rows = pair_rows(120)
    for i, row in enumerate(rows):
        row["answer"] = " ".join([row["answer"]] * (1 + i % 4))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows)
    job = Seq2SeqJob(t5, 4, 8, data=DataConfig(data=pairs, **_fields()))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(t5, local_files_only=True).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    plain, alike = [], 0.0
    for step in range(2):
        parts = [job.batch(2 * step + m) for m in range(2)]
        packed, labels = (torch.cat(t) for t in zip(*parts))
        assert len({int((y != -100).sum()) for _, y in parts}) == 2  # uneven counts
        loss = model(input_ids=packed[:, 0], attention_mask=packed[:, 1], labels=labels).loss
        if step == 0:
            with torch.no_grad():
                halves = [
                    model(input_ids=p[:, 0], attention_mask=p[:, 1], labels=y) for p, y in parts
                ]
                alike = sum(float(h.loss) for h in halves) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        plain.append(loss.item())
    return t5, pairs, plain, alike


_UNEVEN = ["--eval-batches", "0", "--steps", "2", "--swap-policy", "none"]
_UNEVEN += ["--optimizer", "sgd", "--lr", "0.5", "--momentum", "0", *_FIELDS]


def test_accumulated_pairs_weigh_each_micro_batch_by_its_scored_labels(tmp_path: Path) -> None:
    """Labels padded with -100 score different counts per micro-batch, and one loss over
    the whole batch (a plain loop's, and Hugging Face's Trainer's across accumulation) is
    their count-weighted mean: so are the run's losses and its update (``--accumulate 2``)."""
    t5, pairs, plain, alike = _uneven_pairs(tmp_path)
    run = _train(tmp_path, "run", t5, "--data", pairs, *_UNEVEN, "--accumulate", "2")
    assert run["losses"] == pytest.approx(plain, rel=2e-6)
    assert run["losses"][0] != pytest.approx(alike, rel=1e-4)  # not the halves' plain mean


@pytest.mark.dist
@pytest.mark.slow  # the rule's arithmetic across ranks: tests/test_loss_share.py
def test_two_ranks_weigh_their_pairs_by_the_labels_every_rank_scores(tmp_path: Path) -> None:
    """Rank r of 2 reads the half that micro-batch r of one rank accumulating 2 reads: the
    ranks' counts meet (one number each per step), and the run is the plain loop's."""
    t5, pairs, plain, _ = _uneven_pairs(tmp_path)
    run = _train(tmp_path, "run", t5, "--data", pairs, *_UNEVEN, "--nproc", "2")
    assert run["losses"] == pytest.approx(plain, rel=2e-6)
