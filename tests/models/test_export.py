"""pipeswap/models/export.py: the trained model back in the format it came in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeswap.cli import main
from pipeswap.config import replace_fields
from pipeswap.data import dataset_for
from pipeswap.data_config import UserData
from pipeswap.dist.digest import params_sha256
from pipeswap.errors import PipeswapError
from pipeswap.models.export import MARKER, check_save_target, export_model, source_module
from pipeswap.models.registry import build_model

MODES = {
    "data parallel": [],
    "2 ranks": ["--nproc", "2"],
    "emulated pipeline": ["--pipeline", "2", "--emulate"],
    "pipeline": ["--pipeline", "2"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_hugging_face_model_comes_back_as_a_directory_with_the_trained_weights(
    tmp_path: Path, mode: str
) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    source = save_model(tmp_path / "gpt", "gpt2")
    (Path(source) / "tokenizer_config.json").write_text("{}")  # copied beside the weights
    out, report = tmp_path / "trained", tmp_path / "r.json"
    argv = ["train", "--model", source, "--seq-len", "16", "--steps", "3", *MODES[mode]]
    assert main([*argv, "--save", str(out), "--report", str(report)]) == 0
    trained = json.loads(report.read_text())["params_sha256"]
    # Loaded back by pipeswap: the very parameters the run reported.
    assert params_sha256(build_model(str(out))) == trained
    # Loaded back by transformers alone, offline: the trained weights, not the start.
    plain = transformers.GPT2LMHeadModel.from_pretrained(out, local_files_only=True)
    start = transformers.GPT2LMHeadModel.from_pretrained(source, local_files_only=True)
    assert not torch.equal(
        plain.transformer.h[0].mlp.c_fc.weight, start.transformer.h[0].mlp.c_fc.weight
    )
    assert (out / "tokenizer_config.json").is_file() and (out / MARKER).is_file()


def test_other_modules_come_back_as_safetensors_of_their_own_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.models.tiny_lm import tiny_lm

    model = build_model("tests.models.tiny_lm:tiny_lm")
    root = source_module(model)
    assert root is not model  # the user's module, which the LayeredModel shares weights with
    export_model(model, str(tmp_path / "out"), source="tests.models.tiny_lm:tiny_lm", steps=1)
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert set(saved) <= set(tiny_lm().state_dict())  # the user's names (tied ones once)
    for name, tensor in saved.items():
        assert torch.equal(tensor, root.state_dict()[name])
    zoo = build_model("gpt2-micro")
    export_model(zoo, str(tmp_path / "zoo"), source="gpt2-micro", steps=1)
    assert set(load_file(tmp_path / "zoo" / "model.safetensors")) <= set(zoo.state_dict())


def test_a_save_never_overwrites_what_the_user_wrote(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "file").write_text("keep")
    for target, message in (
        ("mine", "holds files pipeswap did not write"),
        ("file", "it is a file; name a directory"),
    ):
        with pytest.raises(PipeswapError, match=message):
            check_save_target(str(tmp_path / target), "gpt2-micro")
    with pytest.raises(PipeswapError, match="over .* the model it started from"):
        check_save_target(str(tmp_path / "mine"), str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    # An earlier save is replaced whole.
    zoo = build_model("gpt2-micro")
    export_model(zoo, str(tmp_path / "out"), source="gpt2-micro", steps=1)
    (tmp_path / "out" / "stale.bin").write_text("from before")
    export_model(zoo, str(tmp_path / "out"), source="gpt2-micro", steps=2)
    assert not (tmp_path / "out" / "stale.bin").exists()
    assert json.loads((tmp_path / "out" / MARKER).read_text())["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_bad_save_target_is_refused_before_training(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("keep")
    # 100000 steps: the refusal comes before any of them.
    argv = ["train", "--model", "gpt2-micro", "--steps", "100000", "--save", str(tmp_path / "file")]
    assert main(argv) == 2
    assert "it is a file; name a directory" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [[], ["--pipeline", "2", "--emulate"]])
def test_a_saved_model_scores_the_held_out_loss_the_report_states(
    tmp_path: Path, mode: list[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    source = save_model(tmp_path / "gpt", "gpt2", dropout=0.1)  # eval mode turns it off
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i}: the quick brown fox, {i * 7 % 13}" for i in range(400)))
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(f"other {i}: a lazy dog {i % 5}" for i in range(60)))
    out, report = tmp_path / "trained", tmp_path / "r.json"
    argv = ["train", "--model", source, "--seq-len", "16", "--batch", "4", "--steps", "3"]
    argv += ["--data", str(corpus), "--eval-data", str(held_out), "--eval-batches", "3"]
    assert main([*argv, *mode, "--save", str(out), "--report", str(report)]) == 0
    stated = json.loads(report.read_text())["eval"]
    assert stated["batches"] == 3
    model = transformers.GPT2LMHeadModel.from_pretrained(out, local_files_only=True).eval()
    held = dataset_for(source, seq_len=16, split="val", data=UserData(str(held_out), "text", "all"))
    losses = []
    with torch.no_grad():
        for index in range(3):
            inputs, targets = held.batch(4, index)
            logits = model(input_ids=inputs).logits
            losses.append(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            )
    assert float(sum(losses) / 3) == pytest.approx(stated["loss"], rel=1e-5)


@pytest.mark.parametrize(
    "mode",
    [
        [],
        ["--pipeline", "2", "--emulate"],
        ["--pipeline", "2", "--schedule", "async-1f1b"],
        ["--pipeline", "2", "--replicas", "2", "--emulate"],  # replica 0's files are the model
    ],
)
def test_export_turns_a_checkpoint_into_the_model_save_writes(
    tmp_path: Path, mode: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    source = save_model(tmp_path / "gpt", "gpt2")  # tied: a pipeline's stages share a weight
    argv = ["train", "--model", source, "--seq-len", "16", "--batch", "4", "--steps", "4"]
    argv += ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3", *mode]
    assert main([*argv, "--save", str(tmp_path / "saved")]) == 0
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == [
        "step-00000003",
        "step-00000004",  # the last step is checkpointed too
    ]
    exported_argv = ["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exported")]
    assert main([*exported_argv, "--model", source]) == 0
    assert "after 4 steps" in capsys.readouterr().out
    exported = params_sha256(build_model(str(tmp_path / "exported")))
    assert exported == params_sha256(build_model(str(tmp_path / "saved")))
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "nothing: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert "no complete checkpoint there" in capsys.readouterr().err


def test_train_hands_back_the_trained_state_dict_by_the_model_s_own_names(
    tmp_path: Path,
) -> None:
    from pipeswap.checkpoint import CheckpointConfig
    from pipeswap.config import ConfigError
    from pipeswap.train_config import TrainConfig
    from pipeswap.training.run import train

    config = TrainConfig(
        "tests.models.tiny_lm:tiny_lm",
        batch=4,
        seq_len=16,
        steps=2,
        progress=False,
        checkpoint=CheckpointConfig(save=str(tmp_path / "out")),
    )
    outcome = train(config)
    assert outcome is not None
    # The user's module takes them by its own names (tied weights once, strict=False).
    model = build_model("tests.models.tiny_lm:tiny_lm")
    missing, unexpected = source_module(model).load_state_dict(outcome.state_dict(), strict=False)
    assert unexpected == [] and params_sha256(model) == outcome.report.params_sha256
    unsaved = train(replace_fields(config, save=None, steps=1))
    assert unsaved is not None
    with pytest.raises(ConfigError, match="give save DIR"):
        unsaved.state_dict()
