"""pipeswap/training/export.py: a checkpoint is data, and never makes export import anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pipeswap.cli import main
from pipeswap.dist.digest import params_sha256
from pipeswap.models.registry import build_model


def _checkpoint(tmp_path: Path, model: str = "gpt2-micro") -> Path:
    ckpt = tmp_path / "ck"
    argv = ["train", "--model", model, "--seq-len", "8", "--batch", "2", "--steps", "1"]
    assert main([*argv, "--checkpoint-dir", str(ckpt), "--eval-batches", "0"]) == 0
    return ckpt


def _name_in_manifest(ckpt: Path, name: str) -> None:
    (manifest_path,) = ckpt.glob("step-*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    manifest["identity"]["model"] = name
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("named", ["this:zen", "os:abort", "planted:run", "os:fork"])
def test_export_never_imports_what_a_manifest_names(
    tmp_path: Path,
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt = _checkpoint(tmp_path)
    _name_in_manifest(ckpt, named)
    # A module planted beside the checkpoint, export started from there: never imported.
    (ckpt / "planted.py").write_text("raise SystemExit('planted module ran')\n")
    monkeypatch.chdir(ckpt)
    monkeypatch.syspath_prepend(str(ckpt))
    before = set(sys.modules)
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr()
    assert "The Zen of Python" not in err.out
    assert f"pass --model {named}" in err.err and "never makes pipeswap import" in err.err
    assert not {"this", "planted"} & (set(sys.modules) - before)
    assert not (tmp_path / "out").exists()


def test_a_zoo_name_in_a_manifest_never_reads_a_directory_of_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model gpt2-micro`` means the user's directory ./gpt2-micro where it holds a model;
    a checkpoint recording the zoo's gpt2-micro, exported from a folder where such a
    directory was planted, must not read it unless the user names it."""
    ckpt = _checkpoint(tmp_path)
    planted = ckpt / "gpt2-micro"
    planted.mkdir()
    (planted / "config.json").write_text('{"architectures": ["Planted"], "model_type": "x"}')
    monkeypatch.chdir(ckpt)
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    assert "pass --model gpt2-micro" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_model_other_than_the_one_the_checkpoint_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    out = str(tmp_path / "out")
    assert main(["export", str(ckpt), "--out", out, "--model", "gpt2-tiny"]) == 2
    assert "was trained from 'gpt2-micro', not 'gpt2-tiny'" in capsys.readouterr().err
    _name_in_manifest(ckpt, "os:abort")
    assert main(["export", str(ckpt), "--out", out, "--model", "gpt2-micro"]) == 2
    assert "pass --model os:abort" in capsys.readouterr().err
    assert not Path(out).exists()


def test_a_user_model_exports_when_the_user_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    source = save_model(tmp_path / "gpt", "gpt2")
    ckpt = _checkpoint(tmp_path, source)
    out = tmp_path / "out"
    assert main(["export", str(ckpt), "--out", str(out)]) == 2
    assert f"pass --model {source}" in capsys.readouterr().err
    # The same directory by another path (relative, from its parent) names the same model.
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(ckpt), "--out", str(out), "--model", "gpt"]) == 0
    assert params_sha256(build_model(str(out))) != params_sha256(build_model(source))


@pytest.mark.parametrize("mode", [["--nproc", "1"], ["--pipeline", "2", "--emulate"]])
def test_a_step_folder_exports_that_step(tmp_path: Path, mode: list[str]) -> None:
    # Before: export read only the newest step ("no complete checkpoint there" for a step
    # folder), so an earlier (or the last good) step could not be had.
    from pipeswap.models.export import load_saved

    argv = ["train", "--model", "gpt2-micro", "--seq-len", "8", "--batch", "2", *mode]
    argv += ["--eval-batches", "0", "--lr-decay-steps", "3"]
    ckpt, alone = tmp_path / "ck", tmp_path / "alone"
    assert (
        main([*argv, "--steps", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]) == 0
    )
    assert main([*argv, "--steps", "2", "--save", str(alone)]) == 0
    out = tmp_path / "out"
    assert main(["export", str(ckpt / "step-00000002"), "--out", str(out)]) == 0
    exported, saved = load_saved(str(out)), load_saved(str(alone))
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[name], exported[name]) for name in saved)
    assert (ckpt / "step-00000003").is_dir()  # the newest is left as it was
