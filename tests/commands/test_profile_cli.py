"""`pipeswap profile`, run in-process through pipeswap.cli.main."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from pipeswap.cli import main
from pipeswap.hardware.gpus import gpu_names
from pipeswap.models import model_spec
from pipeswap.profiling.profile import Profile

Capture = pytest.CaptureFixture[str]


def test_measure_writes_the_contract_and_prints_a_table(tmp_path: Path, capsys: Capture) -> None:
    out = tmp_path / "p.json"
    code = main(
        [
            "profile",
            "--model",
            "gpt2-micro",
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--optimizer",
            "adam",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    obj = json.loads(out.read_text())
    for key in (
        "format",
        "model",
        "batch",
        "seq_len",
        "dtype",
        "source",
        "device",
        "optimizer",
        "optimizer_state_bytes",
        "layers",
    ):
        assert key in obj, key
    assert (obj["format"], obj["model"], obj["batch"], obj["seq_len"]) == (
        "pipeswap.profile/1",
        "gpt2-micro",
        2,
        16,
    )
    assert (obj["dtype"], obj["source"], obj["device"], obj["optimizer"]) == (
        "float32",
        "measured",
        "cpu",
        "adam",
    )
    assert [layer["name"] for layer in obj["layers"]] == ["embed", "block0", "block1", "head"]
    for layer in obj["layers"]:
        assert set(layer) >= {
            "name",
            "forward_s",
            "backward_s",
            "param_bytes",
            "output_bytes",
            "saved",
        }
        assert [t["index"] for t in layer["saved"]] == list(range(len(layer["saved"])))
        assert all(set(t) == {"index", "bytes"} for t in layer["saved"])
    profile = Profile.load(out)
    assert obj["optimizer_state_bytes"] == 2 * profile.param_bytes
    printed = capsys.readouterr().out
    assert "gpt2-micro, batch 2, seq_len 16, float32, measured on cpu, optimizer adam" in printed
    for name in profile.layer_names + ["total"]:
        assert any(line.startswith(name + " ") for line in printed.splitlines()), name
    assert "peak memory of one training step" in printed
    assert printed.rstrip().endswith(f"wrote {out}")


def test_json_flag_prints_what_it_writes(tmp_path: Path, capsys: Capture) -> None:
    out = tmp_path / "p.json"
    code = main(
        [
            "profile",
            "--model",
            "vit-micro",
            "--batch",
            "2",
            "--estimate",
            "--gpu",
            "h200",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert (printed["source"], printed["device"], printed["dtype"]) == (
        "estimate",
        "h200",
        "float32",
    )
    assert printed["image_size"] == model_spec("vit-micro").default_image_size


def test_defaults_come_from_the_zoo(tmp_path: Path, capsys: Capture) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "gpt2-micro", "--estimate", "--out", str(out)]) == 0
    profile = Profile.load(out)
    spec = model_spec("gpt2-micro")
    assert (profile.batch, profile.seq_len, profile.device) == (
        spec.default_batch,
        spec.default_seq_len,
        "v100-32gb",
    )
    assert capsys.readouterr().out.splitlines()[-2] == (
        "GPU v100-32gb: 32.00 GiB memory; the step fits"
    )


def test_estimate_that_does_not_fit_warns(tmp_path: Path, capsys: Capture) -> None:
    out = tmp_path / "p.json"
    code = main(
        [
            "profile",
            "--model",
            "gpt2-small",
            "--batch",
            "16",
            "--seq-len",
            "1024",
            "--estimate",
            "--gpu",
            "rtx2080ti",
            "--out",
            str(out),
        ]
    )
    assert code == 0  # the profile is written; the warning says it will not fit
    captured = capsys.readouterr()
    needed = Profile.load(out).peak_training_bytes() / 2**30
    assert captured.err.startswith("pipeswap profile: warning: one training step of gpt2-small")
    assert f"needs {needed:.2f} GiB but a rtx2080ti has 11.00 GiB" in captured.err
    assert "the step does NOT fit" in captured.out


def _fails(args: list[str], capsys: Capture) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"pipeswap {args[0]}: error: ")
    return captured.err


def test_unknown_model_lists_the_zoo(tmp_path: Path, capsys: Capture) -> None:
    err = _fails(["profile", "--model", "gpt9", "--out", str(tmp_path / "p.json")], capsys)
    assert "unknown model 'gpt9'" in err and "gpt2-tiny" in err and "resnet50" in err
    assert not (tmp_path / "p.json").exists()


def test_bad_gpu_lists_the_specs(tmp_path: Path, capsys: Capture) -> None:
    err = _fails(
        [
            "profile",
            "--model",
            "gpt2-micro",
            "--estimate",
            "--gpu",
            "a99",
            "--out",
            str(tmp_path / "p.json"),
        ],
        capsys,
    )
    assert "unknown GPU spec 'a99'" in err
    assert all(name in err for name in gpu_names())


def test_gpu_without_estimate_is_refused(tmp_path: Path, capsys: Capture) -> None:
    err = _fails(
        ["profile", "--model", "gpt2-micro", "--gpu", "h200", "--out", str(tmp_path / "p.json")],
        capsys,
    )
    assert "--gpu applies to --estimate" in err


def test_saved_on_host_profiles_the_same_tensors(tmp_path: Path, capsys: Capture) -> None:
    written = {}
    for on_host in (False, True):
        out = tmp_path / f"p{on_host}.json"
        args = ["profile", "--model", "gpt2-micro", "--batch", "2", "--seq-len", "16"]
        args += ["--repeats", "1", "--out", str(out)] + (["--saved-on-host"] if on_host else [])
        assert main(args) == 0
        written[on_host] = Profile.load(str(out))
    assert written[True].notes["saved_on_host"] and not written[False].notes["saved_on_host"]
    assert [layer.saved for layer in written[True].layers] == [
        layer.saved for layer in written[False].layers
    ]
    err = _fails(
        ["profile", "--model", "gpt2-micro", "--estimate", "--saved-on-host"]
        + ["--out", str(tmp_path / "e.json")],
        capsys,
    )
    assert "--saved-on-host applies to a measured profile" in err


def test_shape_flag_must_match_the_task(tmp_path: Path, capsys: Capture) -> None:
    out = str(tmp_path / "p.json")
    err = _fails(["profile", "--model", "resnet-micro", "--seq-len", "8", "--out", out], capsys)
    assert "image model: pass --image-size" in err
    err = _fails(["profile", "--model", "gpt2-micro", "--image-size", "32", "--out", out], capsys)
    assert "language model: pass --seq-len" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_suggests_estimate(tmp_path: Path, capsys: Capture) -> None:
    err = _fails(
        ["profile", "--model", "gpt2-micro", "--device", "cuda", "--out", str(tmp_path / "p.json")],
        capsys,
    )
    assert "CUDA is not available" in err and "--estimate --gpu SPEC" in err


def test_allocation_failure_names_the_memory_needed(
    tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The package re-exports the function measure(); patch the module's step runner.
    measure_module = importlib.import_module("pipeswap.profiling.measure")

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")

    monkeypatch.setattr(measure_module, "run_step", out_of_memory)
    err = _fails(
        ["profile", "--model", "gpt2-micro", "--batch", "2", "--out", str(tmp_path / "p.json")],
        capsys,
    )
    assert "gpt2-micro at batch 2 does not fit on cpu" in err
    assert "(meta estimate)" in err and "iB" in err
    assert "try a smaller --batch or --estimate --gpu SPEC" in err
    assert not (tmp_path / "p.json").exists()


def test_sequence_longer_than_the_context_is_refused(tmp_path: Path, capsys: Capture) -> None:
    err = _fails(
        [
            "profile",
            "--model",
            "gpt2-micro",
            "--seq-len",
            "4096",
            "--estimate",
            "--out",
            str(tmp_path / "p.json"),
        ],
        capsys,
    )
    assert "exceeds this model's context" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "gpt2-micro", "--batch", "0"], "--batch is 0; use a whole number >= 1"),
        (["--model", "gpt2-micro", "--batch", "-2"], "--batch is -2"),
        (["--model", "gpt2-micro", "--seq-len", "0"], "--seq-len is 0; use a whole number >= 1"),
        (["--model", "gpt2-micro", "--seq-len", "-4"], "--seq-len is -4"),
        (["--model", "resnet-micro", "--image-size", "0"], "--image-size is 0"),
        (["--model", "gpt2-micro", "--repeats", "0"], "--repeats is 0; use a whole number >= 1"),
        (["--model", "gpt2-micro", "--warmup", "-1"], "--warmup is -1; use a whole number >= 0"),
        (
            ["--model", "vgg-micro", "--image-size", "7", "--estimate"],
            "--image-size 7 is too small for vgg-micro",
        ),
    ],
)
def test_bad_sizes_exit_2_with_a_message(
    tmp_path: Path, capsys: Capture, extra: list[str], message: str
) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not out.exists()


def test_a_token_sequence_classifier_is_refused_saying_why_not_fed_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.models.hf_configs import save_config

    model = save_config(
        tmp_path / "bertcls", "bert", architectures=["BertForSequenceClassification"]
    )
    out = str(tmp_path / "p.json")
    for argv in (
        ["profile", "--model", model, "--seq-len", "16", "--out", out],
        ["profile", "--model", model, "--out", out],
        ["plan", "--estimate", model, "--topology", "switch-4", "--policy", "disjoint"],
    ):
        assert main(argv) == 2
        assert "classifies token sequences" in capsys.readouterr().err
