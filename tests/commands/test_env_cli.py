"""`pipeswap env`, run in-process through pipeswap.cli.main.

Covers: pipeswap/commands/env.py.
"""

from __future__ import annotations

import json
import platform

import pytest
import torch

import pipeswap
from pipeswap.cli import main
from pipeswap.hardware import detect
from pipeswap.hardware.presets import preset

Capture = pytest.CaptureFixture[str]


def _no_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detect, "detect_topology", lambda **kwargs: None)


def test_json_reports_versions_and_backends(capsys: Capture, monkeypatch) -> None:
    _no_topology(monkeypatch)
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {
        "pipeswap",
        "python",
        "torch",
        "cuda_available",
        "cuda_version",
        "nccl_available",
        "gloo_available",
        "gpus",
        "topology",
    }
    assert info["pipeswap"] == pipeswap.__version__
    assert info["python"] == platform.python_version()
    assert info["torch"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()
    assert info["gloo_available"] == torch.distributed.is_gloo_available()
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert info["topology"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_text_on_a_cpu_machine(capsys: Capture, monkeypatch) -> None:
    _no_topology(monkeypatch)
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["pipeswap", pipeswap.__version__]
    assert lines[2].split() == ["torch", torch.__version__]
    assert "cuda available  no" in lines
    assert "gpus            none" in lines
    assert lines[-1] == "topology        none detected"


def test_detected_topology_is_shown(capsys: Capture, monkeypatch) -> None:
    topology = preset("switch-4")
    monkeypatch.setattr(detect, "detect_topology", lambda **kwargs: topology)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"topology        {topology.name}: 4 GPUs, 2 switches, 1 CPUs" in out
    assert f"{len(topology.links)} links" in out
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topology"] == topology.to_json()


def test_a_failing_detector_is_reported_not_raised(capsys: Capture, monkeypatch) -> None:
    def broken(**kwargs: object) -> None:
        raise OSError("NVML driver mismatch")

    monkeypatch.setattr(detect, "detect_topology", broken)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "topology        none detected (detection failed: OSError: NVML driver mismatch)" in out
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topology_error"] == "OSError: NVML driver mismatch"
