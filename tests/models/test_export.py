"""pipeswap/models/export.py: the trained model back in the format it came in."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipeswap.checkpoint import latest_complete
from pipeswap.cli import main
from pipeswap.config_fields import replace_fields
from pipeswap.data import dataset_for
from pipeswap.data_config import UserData
from pipeswap.dist.digest import params_sha256
from pipeswap.errors import PipeswapError
from pipeswap.models.export import (
    MARKER,
    check_save_target,
    export_model,
    load_saved,
    source_module,
)
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
    # Copied beside the weights: the tokenizer's, and what preprocesses (an image
    # processor's normalization, a chat template) as the source directory did.
    beside = ("tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja")
    for name in beside:
        (Path(source) / name).write_text("{}")
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
    assert all((out / name).is_file() for name in beside) and (out / MARKER).is_file()


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


def test_a_second_save_replaces_its_own_files_and_keeps_the_user_s(tmp_path: Path) -> None:
    out = tmp_path / "out"
    zoo = build_model("gpt2-micro")
    export_model(zoo, str(out), source="gpt2-micro", steps=1)
    (out / "notes.txt").write_text("keep")
    (out / "mine").mkdir()
    (out / "mine" / "extra.safetensors").write_text("keep")
    (out / "stray.safetensors").write_text("keep")  # the user's: no part of the model
    # A file the earlier save wrote (its marker lists it) that this one no longer writes.
    (out / "model-00002-of-00002.safetensors").write_text("old shard")
    marker = json.loads((out / MARKER).read_text())
    assert marker["files"] == ["model.safetensors"]
    marker["files"].append("model-00002-of-00002.safetensors")
    (out / MARKER).write_text(json.dumps(marker))
    with torch.no_grad():
        next(zoo.parameters()).add_(1.0)
    export_model(zoo, str(out), source="gpt2-micro", steps=2)
    assert (out / "notes.txt").read_text() == "keep"
    assert (out / "mine" / "extra.safetensors").read_text() == "keep"
    assert (out / "stray.safetensors").read_text() == "keep"
    assert not (out / "model-00002-of-00002.safetensors").exists()
    marker = json.loads((out / MARKER).read_text())
    assert marker["steps"] == 2 and marker["files"] == ["model.safetensors"]
    # The new weights, read from the files the save lists (not the user's beside them).
    assert _holds_weights_of(load_saved(str(out)), zoo)
    assert sorted(p.name for p in [*tmp_path.iterdir(), *out.iterdir()] if p.name[0] == ".") == []


def test_a_save_never_overwrites_a_user_file_with_a_saved_file_s_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    zoo = build_model("gpt2-micro")
    export_model(zoo, str(out), source="gpt2-micro", steps=1)
    (out / MARKER).write_text(json.dumps({"format": "pipeswap.save/1", "files": []}))
    (out / "model.safetensors").write_text("the user's")  # not a file the marker lists
    with pytest.raises(PipeswapError, match=r"not a file pipeswap wrote.*written to") as raised:
        export_model(zoo, str(out), source="gpt2-micro", steps=2, checkpoints=[str(tmp_path)])
    assert (out / "model.safetensors").read_text() == "the user's"
    (fallback,) = tmp_path.glob("pipeswap-saved-model-*")
    assert str(fallback) in str(raised.value) and load_saved(str(fallback))


def test_a_marker_never_names_a_file_outside_its_directory(tmp_path: Path) -> None:
    out, outside = tmp_path / "out", tmp_path / "outside.txt"
    outside.write_text("keep")
    zoo = build_model("gpt2-micro")
    export_model(zoo, str(out), source="gpt2-micro", steps=1)
    files = ["../outside.txt", str(outside), "model.safetensors", MARKER]
    (out / MARKER).write_text(json.dumps({"format": "pipeswap.save/1", "files": files}))
    export_model(zoo, str(out), source="gpt2-micro", steps=2)
    assert outside.read_text() == "keep" and (out / MARKER).is_file()


def _holds_weights_of(saved: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    state = source_module(model).state_dict()
    return bool(saved) and all(torch.equal(tensor, state[name]) for name, tensor in saved.items())


def _fail_renames_into(folder: Path, code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rename into ``folder`` fails with ``code`` (a disk gone read-only, or full)."""
    rename = os.replace

    def failing(src: Any, dst: Any) -> None:
        if Path(dst).resolve().parent == folder.resolve():
            raise OSError(code, os.strerror(code), str(dst))
        rename(src, dst)

    monkeypatch.setattr(os, "replace", failing)


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_save_that_fails_at_the_end_is_written_beside_the_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    out, checkpoints = tmp_path / "out", tmp_path / "ck"
    checkpoints.mkdir()
    _fail_renames_into(out, code, monkeypatch)
    zoo = build_model("gpt2-micro")
    with pytest.raises(PipeswapError) as raised:
        export_model(zoo, str(out), source="gpt2-micro", steps=1, checkpoints=[str(checkpoints)])
    (fallback,) = checkpoints.glob("pipeswap-saved-model-*")
    reason = "read-only file system" if code == errno.EROFS else "the disk is full"
    assert f"cannot save the model to {out} ({reason}); it was written to {fallback}" in str(
        raised.value
    )
    assert _holds_weights_of(load_saved(str(fallback)), zoo)
    assert not out.exists()  # what the failed save made is gone; nothing else was there


def test_without_checkpoints_the_fallback_is_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, temporary = tmp_path / "out", tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    _fail_renames_into(out, errno.EROFS, monkeypatch)
    with pytest.raises(PipeswapError, match=f"written to {temporary}/pipeswap-saved-model-"):
        export_model(build_model("gpt2-micro"), str(out), source="gpt2-micro", steps=1)
    # Nowhere to write at all: the error says the last checkpoint still holds the model.

    def full(**kwargs: Any) -> str:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with pytest.raises(PipeswapError, match=r"nor anywhere else .*last checkpoint is in ck"):
        export_model(build_model("gpt2-micro"), str(out), source="g", steps=1, checkpoints=["ck"])


def test_a_bad_save_target_is_refused_before_training(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("keep")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    checkpoints = str(tmp_path / "ck")
    for save, message in (
        ("file", "it is a file; name a directory"),
        ("mine", "holds files pipeswap did not write (notes.txt); name a new or empty directory"),
        ("ck", "it is the run's checkpoint directory; name another directory"),
    ):
        # 100000 steps: the refusal comes before any of them, and before the checkpoints.
        argv = ["train", "--model", "gpt2-micro", "--steps", "100000", "--checkpoint-dir"]
        assert main([*argv, checkpoints, "--save", str(tmp_path / save)]) == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_save_into_an_earlier_save_keeps_the_user_s_files_and_the_run_s_checkpoints(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    argv = ["train", "--model", "gpt2-micro", "--seq-len", "8", "--batch", "2"]
    argv += ["--save", str(out), "--checkpoint-dir", str(out / "ck")]
    assert main([*argv, "--steps", "2"]) == 0
    (out / "notes.txt").write_text("keep")
    assert main([*argv, "--steps", "3"]) == 0
    assert (out / "notes.txt").read_text() == "keep"
    assert [p.name for p in sorted((out / "ck").glob("step-*"))] == [
        "step-00000002",
        "step-00000003",
    ]
    assert latest_complete(out / "ck") is not None
    assert json.loads((out / MARKER).read_text())["steps"] == 3
    assert load_saved(str(out))


def _refuse_writes(folder: Path, monkeypatch: pytest.MonkeyPatch, *, read_only: bool) -> None:
    """``folder`` as a read-only file system shows it (root could write anyway), or as a
    folder without write permission (run as another user; root ignores permissions)."""
    if read_only:
        access, statvfs = os.access, os.statvfs

        def no_access(path: Any, mode: int, **kwargs: Any) -> bool:
            return Path(path) != folder and access(path, mode, **kwargs)

        def flags(path: Any) -> Any:
            found = statvfs(path)
            if Path(path) != folder:
                return found
            return SimpleNamespace(f_flag=found.f_flag | os.ST_RDONLY)

        monkeypatch.setattr(os, "access", no_access)
        monkeypatch.setattr(os, "statvfs", flags)
    else:
        folder.chmod(0o500)


@pytest.mark.parametrize(
    "read_only",
    [
        True,
        pytest.param(
            False,
            marks=pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions"),
        ),
    ],
)
@pytest.mark.parametrize("inside", [False, True])
def test_an_unwritable_save_target_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, read_only: bool, inside: bool
) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    _refuse_writes(folder, monkeypatch, read_only=read_only)
    save = folder / "model" if inside else folder  # a new folder in it, or the folder itself
    try:
        argv = ["train", "--model", "gpt2-micro", "--steps", "100000", "--save", str(save)]
        assert main([*argv, "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    finally:
        folder.chmod(0o700)
    why = "on a read-only file system" if read_only else "permission denied in"
    assert f"cannot save the model to {save}: " in (err := capsys.readouterr().err) and why in err
    assert not (tmp_path / "ck").exists() and list(folder.iterdir()) == []


def test_a_folder_that_says_writable_but_takes_no_file_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """os.access says yes to root anywhere (/proc): creating a file there is the test."""
    folder = tmp_path / "odd"
    folder.mkdir()
    make = tempfile.mkstemp

    def refuse(*args: Any, dir: Any = None, **kwargs: Any) -> Any:  # noqa: A002
        if dir is not None and Path(dir) == folder:
            raise OSError(errno.ENOENT, "No such file or directory")
        return make(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    save = folder / "model"
    argv = ["train", "--model", "gpt2-micro", "--steps", "100000", "--save", str(save)]
    assert main([*argv, "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert f"cannot save the model to {save}: cannot create files in {folder}" in err
    assert not (tmp_path / "ck").exists()


def test_a_save_that_fails_after_training_says_where_the_model_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out, checkpoints = tmp_path / "out", tmp_path / "ck"
    _fail_renames_into(out, errno.EROFS, monkeypatch)  # the disk went read-only meanwhile
    argv = ["train", "--model", "gpt2-micro", "--seq-len", "8", "--batch", "2", "--steps", "2"]
    assert main([*argv, "--save", str(out), "--checkpoint-dir", str(checkpoints)]) == 2
    err = capsys.readouterr().err
    (fallback,) = checkpoints.glob("pipeswap-saved-model-*")
    assert f"cannot save the model to {out} (read-only file system); it was written to " in err
    assert str(fallback) in err
    monkeypatch.undo()
    # The model the last checkpoint holds.
    assert main(["export", str(checkpoints), "--out", str(tmp_path / "exported")]) == 0
    exported = load_saved(str(tmp_path / "exported"))
    saved = load_saved(str(fallback))
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[name], exported[name]) for name in saved)


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
    from pipeswap.config_fields import ConfigError
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
