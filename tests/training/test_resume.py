"""`pipeswap train --checkpoint-dir/--resume`: interrupted runs resume to the same bits.

Covers: pipeswap/training/resume.py, pipeswap/checkpoint.py, pipeswap/training/dp_rank.py
(checkpoints and SIGTERM), pipeswap/commands/train.py (a stopped run's report and line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeswap.checkpoint import check_identity
from pipeswap.cli import main
from pipeswap.commands.options import flag_of
from pipeswap.config_fields import ConfigError
from pipeswap.dist.faults import FAULT_ENV
from pipeswap.optim import OptimizerConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.resume import identity_fields, run_identity

DP = [
    "train",
    "--model",
    "gpt2-micro",
    "--seq-len",
    "16",
    "--batch",
    "4",
    "--device",
    "cpu",
    "--swap-policy",
    "disjoint",
    "--footprint-ratio",
    "1.2",
]
PIPE = [
    "train",
    "--model",
    "gpt2-micro",
    "--seq-len",
    "16",
    "--batch",
    "4",
    "--pipeline",
    "4",
    "--schedule",
    "async-1f1b",
    "--weights",
    "spectrain",
]


def _report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"] and a["params_sha256"] == b["params_sha256"]


@pytest.mark.dist
def test_data_parallel_rank_killed_then_resumed_ends_as_if_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = [*DP, "--steps", "8", "--nproc", "2"]
    assert main([*run, "--report", str(tmp_path / "alone.json")]) == 0
    monkeypatch.setenv(FAULT_ENV, "1:4")  # rank 1 is SIGKILLed after its fifth step
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    assert main([*run, *ckpt]) == 1
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err
    monkeypatch.delenv(FAULT_ENV)
    assert (
        main([*run, "--resume", str(tmp_path / "ckpt"), "--report", str(tmp_path / "r.json")]) == 0
    )
    _same_run(_report(tmp_path / "r.json"), _report(tmp_path / "alone.json"))
    # Another world size, or another model, is refused with the field that differs.
    assert main([*DP, "--steps", "8", "--resume", str(tmp_path / "ckpt")]) == 2
    assert "--nproc 2, but this run has --nproc 1" in capsys.readouterr().err


def test_sigterm_writes_a_checkpoint_and_the_resumed_run_ends_as_if_left_alone(
    tmp_path: Path,
) -> None:
    run = [*DP, "--steps", "12"]
    assert main([*run, "--report", str(tmp_path / "alone.json")]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env[FAULT_ENV] = "0:4:SIGTERM"  # SIGTERM arrives during step 4 (counted from 0)
    stopped = tmp_path / "stopped.json"
    # Output sent to a file, as `pipeswap train ... > run.log 2>&1` does.
    with open(tmp_path / "run.log", "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "pipeswap", *run, "--checkpoint-dir", str(tmp_path / "ckpt")]
            + ["--log-every", "2", "--report", str(stopped)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
    out = (tmp_path / "run.log").read_text()
    assert done.returncode == 143, out[-2000:]
    # Before: an empty log, no report. Now its lines, what ran, the report of the steps done.
    assert "step 2/12  loss" in out and "step 4/12  loss" in out and "step 6/12" not in out
    assert f"report written to {stopped}" in out and "Traceback" not in out
    assert out.rstrip().endswith(
        f"stopped by SIGTERM after step 5 of 12; its checkpoint is in {tmp_path / 'ckpt'}: "
        f"continue with --resume {tmp_path / 'ckpt'}"
    )
    partial = _report(stopped)
    assert partial["stopped_by"] == "SIGTERM" and partial["steps"] == 12
    assert partial["losses"] == _report(tmp_path / "alone.json")["losses"][:5]
    # One complete set, and the lock file of the directory (pipeswap.checkpoint.hold_directory).
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "step-00000005"]
    assert (
        main([*run, "--resume", str(tmp_path / "ckpt"), "--report", str(tmp_path / "r.json")]) == 0
    )
    _same_run(_report(tmp_path / "r.json"), _report(tmp_path / "alone.json"))


def test_emulated_async_pipeline_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    run = [*PIPE, "--steps", "10", "--emulate"]
    assert main([*run, "--report", str(tmp_path / "alone.json")]) == 0
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4"]
    assert main([*run, *ckpt]) == 0
    assert (
        main([*run, "--resume", str(tmp_path / "ckpt"), "--report", str(tmp_path / "r.json")]) == 0
    )
    _same_run(_report(tmp_path / "r.json"), _report(tmp_path / "alone.json"))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--checkpoint-every", "-1"], "--checkpoint-every is -1"),
        (["--checkpoint-every", "2"], "needs --checkpoint-dir"),
        (["--resume", "/nonexistent/ckpt"], "no such directory"),
    ],
)
def test_bad_checkpoint_options_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*DP, "--steps", "2", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.parametrize(
    "nproc, policy", [("1", "none"), pytest.param("2", "disjoint", marks=pytest.mark.slow)]
)
def test_a_hugging_face_model_resumes_as_if_left_alone(
    tmp_path: Path, nproc: str, policy: str
) -> None:
    # Before: "Unexpected key(s) in state_dict for LayeredModel" on every resume of a
    # model outside the zoo (its layer names are dotted module paths).
    pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    model = save_model(tmp_path / "gpt", "gpt2")
    run = ["train", "--model", model, "--seq-len", "16", "--batch", "4", "--steps", "4"]
    run += ["--nproc", nproc, "--swap-policy", policy, "--device", "cpu"]
    assert main([*run, "--report", str(tmp_path / "alone.json")]) == 0
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    assert main([*run, *ckpt]) == 0
    resumed = ["--resume", str(tmp_path / "ckpt"), "--report", str(tmp_path / "r.json")]
    assert main([*run, *resumed]) == 0
    _same_run(_report(tmp_path / "r.json"), _report(tmp_path / "alone.json"))


def test_a_step_folder_resumes_from_that_step(tmp_path: Path) -> None:
    # Before: "--resume .../step-00000002: no complete checkpoint there".
    base = [*DP[:9], "--nproc", "1", "--lr-decay-steps", "4"]
    ckpt, resumed, alone = tmp_path / "ck", tmp_path / "r.json", tmp_path / "a.json"
    assert (
        main([*base, "--steps", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]) == 0
    )
    again = ["--resume", str(ckpt / "step-00000002"), "--checkpoint-every", "1"]
    assert main([*base, "--steps", "4", *again, "--report", str(resumed)]) == 0
    assert main([*base, "--steps", "4", "--report", str(alone)]) == 0
    _same_run(_report(resumed), _report(alone))
    # Its checkpoints go to the run's directory, never into the step folder.
    assert (ckpt / "step-00000004").is_dir()
    assert not any(p.name.startswith("step-") for p in (ckpt / "step-00000002").iterdir())


def test_a_model_directory_named_another_way_resumes(tmp_path: Path) -> None:
    # Before: "--model ... was written with {model} '/tmp/.../gpt', but this run has
    # '/tmp/.../link/'": the directory was compared as text.
    pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    model = save_model(tmp_path / "gpt", "gpt2")
    (tmp_path / "link").symlink_to(model)
    run = ["--seq-len", "16", "--batch", "4", "--nproc", "1", "--lr-decay-steps", "3"]
    ckpt = tmp_path / "ckpt"
    first = ["train", "--model", model, *run, "--steps", "2", "--checkpoint-dir", str(ckpt)]
    assert main(first) == 0
    again = ["train", "--model", f"{tmp_path / 'link'}/", *run, "--steps", "3"]
    assert main([*again, "--resume", str(ckpt), "--report", str(tmp_path / "r.json")]) == 0
    assert main([*again, "--report", str(tmp_path / "alone.json")]) == 0
    _same_run(_report(tmp_path / "r.json"), _report(tmp_path / "alone.json"))


@pytest.mark.parametrize(
    "mode", [["--nproc", "1"], ["--pipeline", "2", "--schedule", "1f1b", "--emulate"]]
)
def test_a_finished_run_continues_for_more_steps_as_a_longer_run_would(
    tmp_path: Path, mode: list[str]
) -> None:
    base = [*DP[:9], "--lr-schedule", "cosine", "--lr-decay-steps", "5", *mode]
    if "--pipeline" in mode:
        base = [a for a in base if a not in ("--device", "cpu")]
    ckpt, short, longer, whole = (tmp_path / n for n in ("ck", "s.json", "l.json", "w.json"))
    assert main([*base, "--steps", "3", "--checkpoint-dir", str(ckpt), "--report", str(short)]) == 0
    assert (ckpt / "step-00000003").is_dir()  # the last step is checkpointed
    assert main([*base, "--steps", "5", "--resume", str(ckpt), "--report", str(longer)]) == 0
    assert main([*base, "--steps", "5", "--report", str(whole)]) == 0
    _same_run(_report(longer), _report(whole))
    resumed = _report(longer)
    if "--pipeline" in mode:  # its rates are of the 2 steps it ran (they were of all 5)
        assert resumed["measured_step_s"] == pytest.approx(resumed["wall_s"] / 2)
        samples = resumed["samples_per_s"] * resumed["wall_s"]
        assert samples == pytest.approx(2 * resumed["config"]["batch"])


def test_an_async_pipeline_continues_only_for_its_own_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ck"
    argv = [*PIPE[:8], "2", *PIPE[9:], "--emulate"]
    assert main([*argv, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    assert main([*argv, "--steps", "3", "--resume", str(ckpt)]) == 2
    assert "continues only with --steps 2" in capsys.readouterr().err


def test_a_refused_resume_names_the_setting_as_the_caller_does() -> None:
    # Before: "written with lr_decay_steps = 3" to a CLI user who never wrote it.
    config = TrainConfig("gpt2-micro", steps=3, optim=OptimizerConfig(lr_schedule="cosine"))
    written = {"identity": run_identity(config.resolved(), 1)}
    longer = run_identity(replace(config, steps=5).resolved(), 1)
    with pytest.raises(ConfigError) as refused:
        check_identity(written, longer, "the checkpoint ck/step-00000003", identity_fields(longer))
    assert refused.value.render(flag_of) == (
        "the checkpoint ck/step-00000003 was written with --lr-decay-steps 3, but this run has "
        "--lr-decay-steps 5 (--lr-decay-steps defaults to the run's --steps: give "
        "--lr-decay-steps 3 to go on decaying as it did); resume with the same settings or "
        "start afresh"
    )
    assert "written with lr_decay_steps 3" in str(refused.value)  # a Python caller's words


def test_a_resume_is_refused_for_fewer_steps_or_for_what_the_run_did_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hostile input round 4 (UNCLEAR): one rule for what a resume may change."""
    corpus, other = tmp_path / "a.txt", tmp_path / "b.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    other.write_text("pack my box with five dozen liquor jugs now. " * 200)
    ckpt = tmp_path / "ckpt"
    # A constant rate: a language model's default cosine decays over --steps, and this
    # run continues for more.
    base = [*DP, "--data", str(corpus), "--optimizer", "sgd"]
    assert main([*base, "--steps", "4", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    resume = ["--resume", str(ckpt)]
    assert main([*base, "--steps", "2", *resume]) == 2
    assert "has done 4 steps, more than this run's --steps 2" in capsys.readouterr().err
    assert main([*DP, "--data", str(other), "--steps", "5", *resume]) == 2
    assert "written with --data a.txt: 1 file(s)" in capsys.readouterr().err
    corpus.write_text("the quick brown fox jumps over the lazy cat. " * 200)  # changed
    assert main([*base, "--steps", "5", *resume]) == 2
    assert "--data a.txt" in capsys.readouterr().err
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)  # as it was
    assert main([*base, "--steps", "5", "--clip-grad-norm", "1.0", *resume]) == 2
    assert "--clip-grad-norm (none), but this run has --clip-grad-norm 1.0" in (
        capsys.readouterr().err
    )
    assert main([*base, "--steps", "5", *resume]) == 0


def test_a_checkpoint_of_the_old_default_resumes_with_its_own_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every model once defaulted to SGD at 0.05; language models now take AdamW. A
    # checkpoint written then (its identity: sgd, 0.05, no warm-up, constant) resumed
    # without flags goes on with SGD, as the run left alone would have.
    ckpt, resumed, alone = tmp_path / "ckpt", tmp_path / "r.json", tmp_path / "a.json"
    old_default = ["--optimizer", "sgd", "--lr", "0.05", "--lr-warmup", "0"]
    assert main([*DP, *old_default, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    assert main([*DP, "--steps", "4", "--resume", str(ckpt), "--report", str(resumed)]) == 0
    assert main([*DP, *old_default, "--steps", "4", "--report", str(alone)]) == 0
    report = _report(resumed)
    assert (report["optimizer"], report["lr"]) == ("sgd", 0.05)
    assert report["train_config"]["optim"]["lr_schedule"] == "constant"
    _same_run(report, _report(alone))
    # A setting given still wins, and one the checkpoint disagrees with is refused.
    capsys.readouterr()
    assert main([*DP, "--optimizer", "adamw", "--steps", "4", "--resume", str(ckpt)]) == 2
    assert "written with --lr 0.05, but this run has --lr 0.001" in capsys.readouterr().err
