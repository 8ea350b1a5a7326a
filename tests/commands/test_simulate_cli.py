"""Tests of `pipeswap simulate` (pipeswap.commands.simulate)."""

import json

import pytest

from pipeswap.cli import main


@pytest.fixture
def graph_file(tmp_path, contract_graph):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(contract_graph))
    return str(path)


def test_json_output_has_the_documented_shape(graph_file, capsys) -> None:
    assert main(["simulate", "--graph", graph_file, "--topology", "switch-4", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["makespan_s"] == pytest.approx(2.0 + 4 / 12, rel=1e-9)
    assert obj["tasks"]["in0"] == {"start_s": 1.5, "end_s": 2.0}
    assert obj["gpus"]["gpu0"]["peak_bytes"] == 8000000000
    assert {"a", "b", "bytes_ab", "bytes_ba", "busy_s_ab", "busy_s_ba"} <= set(obj["links"][0])


def test_human_table_lists_gpus_and_busy_links(graph_file, capsys) -> None:
    assert main(["simulate", "--graph", graph_file, "--topology", "switch-4"]) == 0
    out = capsys.readouterr().out
    assert "topology switch-4, 5 tasks, makespan 2.33333 s" in out
    assert "gpu0" in out and "7.45 GiB" in out  # 8e9 bytes
    assert "sw0 -> cpu0" in out and "sw1 -> cpu0" not in out


def test_gpu_memory_override_and_out_of_memory(graph_file, capsys) -> None:
    assert (
        main(["simulate", "--graph", graph_file, "--topology", "switch-4", "--gpu-memory", "7GB"])
        == 2
    )
    err = capsys.readouterr().err
    assert "gpu0 is out of memory" in err and "'f0'" in err and "7000000000" in err
    assert (
        main(
            [
                "simulate",
                "--graph",
                graph_file,
                "--topology",
                "switch-4",
                "--gpu-memory",
                "8GB",
                "--json",
            ]
        )
        == 0
    )
    obj = json.loads(capsys.readouterr().out)
    # in0 waits for out0's 6 GB free, as before; 8 GB is exactly enough.
    assert obj["gpus"]["gpu0"]["peak_bytes"] == 8000000000


def test_trace_and_timeline_files(graph_file, tmp_path, capsys) -> None:
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert (
        main(
            [
                "simulate",
                "--graph",
                graph_file,
                "--topology",
                "dual-root-8",
                "--json",
                "--trace",
                str(trace),
                "--timeline",
                str(png),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout stays pure JSON
    assert "wrote trace" in captured.err
    assert any(e["ph"] == "C" for e in json.loads(trace.read_text())["traceEvents"])
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--topology", "quad-9"], "unknown topology 'quad-9'"),
        (["--topology", "switch-4", "--gpu-memory", "lots"], "not a byte size"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(graph_file, capsys, extra, message) -> None:
    assert main(["simulate", "--graph", graph_file, *extra]) == 2
    assert message in capsys.readouterr().err


def test_missing_graph_file(tmp_path, capsys) -> None:
    assert main(["simulate", "--graph", str(tmp_path / "none.json"), "--topology", "switch-4"]) == 2
    assert "no such file" in capsys.readouterr().err


def _cpu_only(tmp_path) -> str:
    path = tmp_path / "cpu-only.json"
    path.write_text(
        json.dumps(
            {
                "format": "pipeswap.topology/1",
                "name": "cpu-only",
                "nodes": [{"id": "cpu0", "kind": "cpu"}, {"id": "sw0", "kind": "switch"}],
                "links": [{"a": "sw0", "b": "cpu0", "gb_per_s": 12.0}],
            }
        )
    )
    return str(path)


def _fractional_memory(tmp_path) -> str:
    path = tmp_path / "fractional.json"
    path.write_text(
        json.dumps(
            {
                "format": "pipeswap.topology/1",
                "name": "fractional",
                "nodes": [
                    {"id": "cpu0", "kind": "cpu"},
                    {"id": "gpu0", "kind": "gpu", "memory_bytes": 1.7},
                ],
                "links": [{"a": "gpu0", "b": "cpu0", "gb_per_s": 12.0}],
            }
        )
    )
    return str(path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpu-memory", "-1"], "not a byte size: '-1'"),
        (["--gpu-memory", "nan"], "not a byte size: 'nan'"),
        (["--gpu-memory", "1.5"], "byte size '1.5' is not a whole number of bytes"),
        (_cpu_only, "topology 'cpu-only' (from "),
        (_cpu_only, "has no GPU; add a node with kind gpu"),
        (_fractional_memory, "node 1 ('gpu0'): memory_bytes is 1.7; write a whole number"),
    ],
)
def test_bad_values_exit_2_without_a_traceback(
    graph_file, tmp_path, capsys, extra, message
) -> None:
    if callable(extra):
        argv = ["--topology", extra(tmp_path)]
    else:
        argv = ["--topology", "switch-4", *extra]
    assert main(["simulate", "--graph", graph_file, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
