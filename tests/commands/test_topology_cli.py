"""`pipeswap topology list|show|detect|calibrate`, run in-process through pipeswap.cli.main.

Covers: pipeswap/commands/topology.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeswap.cli import main
from pipeswap.commands import topology as topology_command
from pipeswap.hardware.presets import preset, preset_description, preset_names
from pipeswap.hardware.render import render_tree
from pipeswap.hardware.topology import Topology


def test_list_prints_every_preset_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    for name, line in zip(preset_names(), lines):
        assert line.endswith(preset_description(name))


def test_show_prints_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "show", "switch-4"]) == 0
    assert capsys.readouterr().out == render_tree(preset("switch-4"))
    assert main(["topology", "show", "dual-root-8", "--pcie", "gen5"]) == 0
    out = capsys.readouterr().out
    assert out == render_tree(preset("dual-root-8", pcie="gen5"))
    assert "50.0 GB/s" in out and "cpu0 ══ 20.0 GB/s inter-socket ══ cpu1" in out


@pytest.mark.parametrize("name", ["switch-4", "single-root-8", "dual-root-8", "direct-4"])
def test_show_json_round_trips_unchanged(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "show", name, "--pcie", "gen4", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj == preset(name, pcie="gen4").to_json()
    assert Topology.from_json(obj).to_json() == obj


def test_show_a_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "server.json"
    topology = preset("direct-4", pcie="gen5", duplex_efficiency=0.5, copy_engines=1)
    topology.save(path)
    assert main(["topology", "show", str(path), "--json"]) == 0
    assert Topology.from_json(json.loads(capsys.readouterr().out)) == topology
    assert main(["topology", "show", str(path)]) == 0
    assert capsys.readouterr().out == render_tree(topology)


def test_show_errors_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["topology", "show", "quad-root-16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeswap topology: error: unknown topology 'quad-root-16'")
    assert all(name in err for name in preset_names())
    path = tmp_path / "server.json"
    preset("switch-4").save(path)
    assert main(["topology", "show", str(path), "--pcie", "gen4"]) == 2
    assert "only apply to preset topologies" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["topology", "show", "switch-4", "--pcie", "gen9"])
    assert info.value.code == 2


def test_detect_without_gpus_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(topology_command, "detect_topology", lambda: None)
    assert main(["topology", "detect"]) == 0
    assert capsys.readouterr().out == (
        "no NVIDIA GPU was found (neither NVML nor nvidia-smi reports one)\n"
    )
    assert main(["topology", "detect", "--json"]) == 0  # stdout stays JSON
    captured = capsys.readouterr()
    assert json.loads(captured.out) is None and "no NVIDIA GPU" in captured.err


def test_detect_prints_what_it_found(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    found = preset("switch-4", pcie="gen4")
    monkeypatch.setattr(topology_command, "detect_topology", lambda: found)
    assert main(["topology", "detect", "--json"]) == 0
    assert Topology.from_json(json.loads(capsys.readouterr().out)) == found
    assert main(["topology", "detect"]) == 0
    assert capsys.readouterr().out == render_tree(found)


def test_detect_on_this_machine_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    # With or without GPUs, detection never fails the command.
    assert main(["topology", "detect"]) == 0
    assert capsys.readouterr().out


def test_no_action_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology"]) == 2
    out = capsys.readouterr().out
    assert "list" in out and "show" in out and "detect" in out


@pytest.mark.parametrize(
    "where, field, value, message",
    [
        (
            "nodes",
            "memory_bytes",
            1.7,
            "node 1 ('gpu0'): memory_bytes is 1.7; write a whole number",
        ),
        ("nodes", "memory_bytes", -5, "memory_bytes is -5; write a whole number of bytes >= 0"),
        ("nodes", "copy_engines", "two", 'copy_engines is "two"; write 1 or 2'),
        ("links", "gb_per_s", -12, "link 0 (gpu0-cpu0): gb_per_s is -12; write a finite"),
        ("links", "gb_per_s", 0, "gb_per_s is 0; write a finite bandwidth > 0"),
        ("links", "gb_per_s", "fast", 'gb_per_s is "fast"; write a finite bandwidth'),
        ("links", "duplex_efficiency", [], "duplex_efficiency is []"),
    ],
)
def test_show_refuses_bad_fields_naming_them(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    where: str,
    field: str,
    value: object,
    message: str,
) -> None:
    obj = {
        "format": "pipeswap.topology/1",
        "name": "bad",
        "nodes": [
            {"id": "cpu0", "kind": "cpu"},
            {"id": "gpu0", "kind": "gpu", "memory_bytes": 2**34},
        ],
        "links": [{"a": "gpu0", "b": "cpu0", "gb_per_s": 12.0}],
    }
    obj[where][1 if where == "nodes" else 0][field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    assert main(["topology", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.dist
def test_calibrate_writes_a_measured_topology(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "here.json"
    assert main(["topology", "calibrate", "--quick", "--nproc", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "all-reduce" in printed and "compute" in printed and f"wrote {out}" in printed
    topology = Topology.load(out)
    assert topology.gpus == ["gpu0", "gpu1"] and topology.calibration is not None
    calibration = topology.calibration
    assert calibration["measured"] is True and calibration["ranks"] == 2
    assert calibration["command"].startswith("pipeswap ") and len(calibration["date"]) == 10
    assert calibration["compute_slowdown"] >= 1.0
    assert calibration["transfer_slowdown"] >= 1.0  # 2 ranks exchange: a figure
    assert calibration["stage_slowdown"] >= 1.0
    assert main(["topology", "show", str(out)]) == 0


def test_calibrate_refuses_no_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert main(["topology", "calibrate", "--nproc", "0", "--out", str(out)]) == 2
    assert "--nproc 0" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    "out,message",
    [
        ("dir", "dir is a directory; give a file name"),
        ("file/t.json", "file is a file, not a folder; choose another path"),
    ],
)
def test_calibrate_refuses_a_bad_out_before_measuring(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    out: str,
    message: str,
) -> None:
    from pipeswap.dist import launch

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("calibrate measured before checking --out")

    monkeypatch.setattr(launch, "spawn", measured)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("keep")
    argv = ["topology", "calibrate", "--quick", "--device", "cpu", "--out", str(tmp_path / out)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "keep" and list((tmp_path / "dir").iterdir()) == []


@pytest.mark.dist
def test_a_calibration_kept_for_this_machine_is_what_runs_plan_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeswap.hardware.calibration import calibrated_path
    from pipeswap.training.data_parallel import default_topology

    monkeypatch.setenv("PIPESWAP_HOME", str(tmp_path))
    assert default_topology("cpu", 2).name == "switch-4"  # none made yet: the preset
    assert main(["topology", "calibrate", "--quick", "--nproc", "2", "--device", "cpu"]) == 0
    kept = calibrated_path("cpu", 2)
    assert kept == tmp_path / "calibrated-cpu-2.json" and f"wrote {kept}" in capsys.readouterr().out
    found = default_topology("cpu", 2)
    assert found.name == "calibrated-cpu-2" and found.calibration is not None
    assert default_topology("cpu", 3).name == "switch-4"  # calibrated for 2 ranks only
