"""pipeswap/metrics.py: the per-step log of a run (terminal lines, JSON lines, TensorBoard)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pipeswap.cli import main
from pipeswap.config_fields import ConfigError
from pipeswap.metrics import LogConfig, StepLog


def test_json_lines_hold_every_step_and_the_held_out_score_last(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with StepLog(LogConfig(metrics=str(path)), 2) as log:
        log.step(0, 5.0, 0.1, 0.25)
        log.step(1, 4.0, 0.1)
        log.close({"batches": 2, "loss": 3.5})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"step": 1, "loss": 5.0, "lr": 0.1, "step_s": 0.25},
        {"step": 2, "loss": 4.0, "lr": 0.1, "step_s": None},
        {"step": 2, "eval": {"batches": 2, "loss": 3.5}},
    ]


def test_the_file_is_written_whole_at_the_end_and_a_resumed_run_keeps_the_steps_before(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("the user's notes\n")
    log = StepLog(LogConfig(metrics=str(path)), 4)
    log.step(0, 5.0, 0.1)
    log.step(1, 4.0, 0.1)
    assert path.read_text() == "the user's notes\n"  # a run cut short leaves it as it was
    log.close()
    assert not (tmp_path / "m.jsonl.partial").exists()
    first = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in first] == [1, 2]
    # The run resumed from its checkpoint after step 1 (a step 2 it logs again).
    with StepLog(LogConfig(metrics=str(path)), 4) as log:
        log.step(1, 3.0, 0.1)
        log.step(2, 2.0, 0.1)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["step"], line["loss"]) for line in lines] == [(1, 5.0), (2, 3.0), (3, 2.0)]


@pytest.mark.parametrize("terminal", [True, False])
def test_a_line_every_n_steps_on_a_terminal_or_in_a_log_file(
    terminal: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a run sent to a log file (`pipeswap train ... > run.log 2>&1`) logged nothing.
    monkeypatch.setattr("sys.stderr.isatty", lambda: terminal)
    with StepLog(LogConfig(log_every=2), 4) as log:
        for step in range(4):
            log.step(step, 1.0 / (step + 1), 0.01, 0.002)
    assert capsys.readouterr().err.splitlines() == [
        "step 2/4  loss 0.5000  lr 0.01  2.0 ms",
        "step 4/4  loss 0.2500  lr 0.01  2.0 ms",
    ]
    with StepLog(LogConfig(log_every=2), 4, enabled=False) as quiet:  # ranks but 0
        quiet.step(1, 1.0, 0.01)
    assert capsys.readouterr().err == ""


def test_bad_log_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="log_every is -1"):
        LogConfig(log_every=-1)
    with pytest.raises(ConfigError, match="metrics is empty"):
        LogConfig(metrics="")


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed"
)
def test_tensorboard_without_its_package_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pip install 'pipeswap\[tensorboard\]'"):
        StepLog(LogConfig(tensorboard=str(tmp_path / "tb")), 1)


def test_tensorboard_without_its_package_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Before: refused by every rank after they had started (48 s), three times, advising
    # `pip install tensorboard` where the README says pipeswap[tensorboard].
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails

    def no_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank started")

    monkeypatch.setattr("pipeswap.dist.launch.spawn", no_ranks)
    argv = ["train", "--model", "gpt2-micro", "--seq-len", "16", "--batch", "4", "--steps", "2"]
    argv += ["--nproc", "2", "--tensorboard", str(tmp_path / "tb")]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.count("needs the tensorboard package") == 1, err
    assert "--tensorboard needs" in err and "pip install 'pipeswap[tensorboard]'" in err


@pytest.mark.parametrize(
    "mode", [["--nproc", "2"], ["--pipeline", "2", "--emulate"], ["--pipeline", "2"]]
)
def test_the_metrics_file_agrees_with_the_report(tmp_path: Path, mode: list[str]) -> None:
    metrics, report = tmp_path / "m.jsonl", tmp_path / "r.json"
    argv = ["train", "--model", "gpt2-micro", "--seq-len", "16", "--batch", "4", "--steps", "3"]
    argv += [
        "--optimizer",
        "sgd",
        "--lr-warmup",
        "2",
        "--eval-every",
        "2",
        "--metrics",
        str(metrics),
    ]
    argv += ["--report", str(report), *mode]
    assert main(argv) == 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    stated = json.loads(report.read_text())
    assert [line["lr"] for line in steps] == pytest.approx([0.025, 0.05, 0.05])
    # The score after step 2 follows its step's line; the score at the end comes last.
    assert lines[2] == {
        "step": 2,
        "eval": {k: v for k, v in stated["evals"][0].items() if k != "step"},
    }
    assert lines[-1]["eval"] == stated["eval"]
    # The mini-batch's loss: the pipeline's last stage's; data parallel, every rank's mean
    # (the summary's, gathered each step; not rank 0's share alone).
    assert [line["loss"] for line in steps] == stated["losses"]
    if "--pipeline" not in mode:
        assert stated["losses"] != stated["losses_per_rank"][0]
