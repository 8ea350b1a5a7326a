"""Your model from the CLI: every Hugging Face family profiled, planned, swapped and pipelined.

Covers the issue's acceptance list with small configs (2 blocks, hidden 32) saved as model
directories: `pipeswap profile --model DIR`, `pipeswap plan` on that profile, `pipeswap
train --model DIR` with swapping (1 and 2 ranks) and with `--pipeline 2` (gpipe, 1f1b,
async-1f1b with spectrain), runtime and `--emulate`. Dropout is on (0.1) wherever the
family has it, and GPT-2 and BERT tie their output layer to the token embedding.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from pipeswap.cli import main
from pipeswap.training.report import load_report
from tests.models.hf_configs import FAMILIES, save_config, save_model

pytest.importorskip("transformers")

_SHAPE = {"gpt2": "--seq-len", "llama": "--seq-len", "bert": "--seq-len"}


def _shape(family: str) -> list[str]:
    return [_SHAPE[family], "16"] if family in _SHAPE else ["--image-size", "32"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {family: save_config(root / family, family, dropout=0.1) for family in FAMILIES}


def _train(tmp_path: Path, name: str, model: str, *argv: str) -> dict[str, Any]:
    report = tmp_path / f"{name}.json"
    assert main(["train", "--model", model, "--device", "cpu", "--report", str(report), *argv]) == 0
    return load_report(report).to_json()  # the file's keys, read back through TrainReport


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_plan_and_swapped_training_equal_plain_training(
    tmp_path: Path, model_dirs: dict[str, str], family: str
) -> None:
    model = model_dirs[family]
    profile = tmp_path / "profile.json"
    common = ["--batch", "4", *_shape(family)]
    assert (
        main(["profile", "--model", model, *common, "--repeats", "1", "--out", str(profile)]) == 0
    )
    layers = [layer["name"] for layer in json.loads(profile.read_text())["layers"]]
    assert layers[0] == "embed" and layers[-1] == "head" and "." in layers[1]
    plan = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--profile",
                str(profile),
                "--topology",
                "switch-4",
                "--gpus",
                "1",
                "--footprint-ratio",
                "1.3",
                "--policy",
                "disjoint",
                "--out",
                str(plan),
            ]
        )
        == 0
    )
    swaps = json.loads(plan.read_text())["gpus"][0]["swaps"]
    assert swaps and all(s["layer"] in layers for s in swaps)
    steps = ["--steps", "3", *common]
    swapped = _train(
        tmp_path, "swap", model, *steps, "--swap-policy", "disjoint", "--footprint-ratio", "1.3"
    )
    plain = _train(tmp_path, "none", model, *steps, "--swap-policy", "none")
    assert swapped["swapped_bytes"][0] > 0
    assert swapped["losses"] == plain["losses"]
    assert swapped["params_sha256"] == plain["params_sha256"]


@pytest.mark.dist
@pytest.mark.parametrize(
    "family",
    # make test-slow: two ranks of the CLI swap in test_train_cli.py's issue command and
    # under the user's own DDP in test_offload.py.
    [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES],
)
def test_two_ranks_swapped_equal_two_ranks_plain(
    tmp_path: Path, model_dirs: dict[str, str], family: str
) -> None:
    steps = ["--steps", "2", "--batch", "4", *_shape(family), "--nproc", "2"]
    swapped = _train(
        tmp_path,
        "swap",
        model_dirs[family],
        *steps,
        "--swap-policy",
        "disjoint",
        "--footprint-ratio",
        "1.2",  # the tiny ViT's blocks hold little: beyond 1.28 swapping cannot reach
    )
    plain = _train(tmp_path, "none", model_dirs[family], *steps, "--swap-policy", "none")
    assert swapped["params_sha256"] == plain["params_sha256"]
    assert swapped["losses_per_rank"] == plain["losses_per_rank"]


_SCHEDULES = (
    ("gpipe", "stale"),
    ("1f1b", "stale"),
    ("async-1f1b", "spectrain"),
)
# make test runs one schedule per family (each schedule on some family);
# make test-slow runs the whole matrix.
_FAST = {
    ("gpt2", "async-1f1b"),
    ("bert", "async-1f1b"),
    ("llama", "1f1b"),
    ("vit", "gpipe"),
}
_MATRIX = [
    pytest.param(
        family,
        schedule,
        weights,
        marks=() if (family, schedule) in _FAST else pytest.mark.slow,
        id=f"{family}-{schedule}",
    )
    for family in FAMILIES
    for schedule, weights in _SCHEDULES
]


@pytest.mark.dist
@pytest.mark.parametrize(("family", "schedule", "weights"), _MATRIX)
def test_pipeline_runtime_equals_emulator_with_dropout_and_tied_weights(
    tmp_path: Path, model_dirs: dict[str, str], family: str, schedule: str, weights: str
) -> None:
    micro = [] if schedule.startswith("async") else ["--micro-batches", "2"]
    argv = [
        "--steps",
        "3",
        "--batch",
        "4",
        *_shape(family),
        "--pipeline",
        "2",
        "--schedule",
        schedule,
        "--weights",
        weights,
        *micro,
    ]
    emulated = _train(tmp_path, "emulate", model_dirs[family], *argv, "--emulate")
    runtime = _train(tmp_path, "runtime", model_dirs[family], *argv, "--nproc", "2")
    assert runtime["losses"] == emulated["losses"]
    assert runtime["params_sha256"] == emulated["params_sha256"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synchronous_pipelines_give_the_losses_of_plain_training(
    tmp_path: Path, family: str, schedule: str
) -> None:
    model = save_config(tmp_path / family, family, dropout=0.0)  # tied for gpt2 and bert
    common = ["--steps", "4", "--batch", "4", *_shape(family), "--optimizer", "sgd"]
    # BatchNorm normalises each micro-batch by its own statistics, so ResNet equals plain
    # training with one micro-batch only (as in GPipe).
    micro = "1" if family == "resnet" else "2"
    plain = _train(tmp_path, "plain", model, *common, "--swap-policy", "none")
    piped = _train(
        tmp_path,
        "piped",
        model,
        *common,
        "--pipeline",
        "2",
        "--schedule",
        schedule,
        "--micro-batches",
        micro,
        "--emulate",
    )
    for ours, theirs in zip(piped["losses"], plain["losses"], strict=True):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)


def test_a_directory_with_weights_trains_from_them(tmp_path: Path) -> None:
    import torch
    import transformers

    from pipeswap.data import dataset_for

    model_dir = save_model(tmp_path / "weights", "gpt2", dropout=0.0)
    report = _train(
        tmp_path,
        "w",
        model_dir,
        "--steps",
        "1",
        "--batch",
        "4",
        "--seq-len",
        "16",
        "--swap-policy",
        "none",
    )
    hf = transformers.GPT2LMHeadModel.from_pretrained(model_dir, local_files_only=True)
    inputs, targets = dataset_for(model_dir, seq_len=16, seed=report["seed"]).batch(4, 0)
    logits = hf(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    assert report["losses"][0] == pytest.approx(loss.item(), rel=1e-6)
    config_only = save_config(tmp_path / "config", "gpt2", dropout=0.0)
    seeded = [
        _train(
            tmp_path,
            f"s{i}",
            config_only,
            "--steps",
            "1",
            "--batch",
            "4",
            "--seq-len",
            "16",
            "--swap-policy",
            "none",
        )["losses"][0]
        for i in range(2)
    ]
    assert seeded[0] == seeded[1] != report["losses"][0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "4096"], "exceeds this model's context"),
        (["--image-size", "32"], "is a language model"),
    ],
)
def test_bad_shapes_for_a_directory_exit_2(
    tmp_path: Path,
    model_dirs: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    code = main(["train", "--model", model_dirs["gpt2"], "--device", "cpu", "--steps", "1", *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_a_module_function_returning_a_hugging_face_model_pipelines(tmp_path: Path) -> None:
    argv = [
        "--steps",
        "2",
        "--batch",
        "4",
        "--pipeline",
        "2",
        "--schedule",
        "1f1b",
        "--micro-batches",
        "2",
        "--emulate",
    ]
    report = _train(tmp_path, "fn", "tests.models.hf_configs:gpt2_module", *argv)
    assert report["seq_len"] == 64  # its context, when --seq-len is left out
    assert len(report["losses"]) == 2


def test_a_language_model_without_a_default_length_asks_for_seq_len(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "train",
            "--model",
            "tests.models.test_load:tiny_lm",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--pipeline",
            "2",
            "--emulate",
        ]
    )
    assert code == 2
    assert "no default sequence length: pass --seq-len N" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [
        ["profile", "--estimate", "--out", "p.json"],
        ["profile", "--device", "cpu", "--out", "p.json"],
        ["plan", "--topology", "switch-4", "--policy", "disjoint", "--estimate"],
    ],
)
def test_a_million_layers_are_refused_in_seconds_naming_the_counted_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    # Before: profile and --estimate built the million blocks until the time limit.
    path = Path(save_config(tmp_path / "deep", "gpt2"))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "n_layer": 10**6}))
    model = [str(path)] if command[-1] == "--estimate" else ["--model", str(path)]
    argv = [c if c != "p.json" else str(tmp_path / "p.json") for c in command]
    started = time.perf_counter()
    assert main([*argv, *model]) == 2
    assert time.perf_counter() - started < 10
    err = capsys.readouterr().err
    assert "has 1,000,000 blocks (n_layer 1,000,000): 12,704,010,304 parameters, 47.33 GiB" in err
    assert "at most 4,096 blocks" in err and "lower n_layer in its config.json" in err
