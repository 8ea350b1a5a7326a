"""Tests of the simulation result contract (pipeswap.sim.result).

Covers: pipeswap/sim/result.py.
"""

import json

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.sim.result import GpuStats, LinkStats, SimResult, TaskTiming


def _result() -> SimResult:
    return SimResult(
        makespan_s=2.5,
        tasks={"a": TaskTiming(0.0, 1.0), "b": TaskTiming(1.0, 2.5)},
        gpus={"gpu0": GpuStats(busy_s=1.0, stall_s=0.5, peak_bytes=10**9, idle_s=1.0)},
        links=[LinkStats("gpu0", "cpu0", 12 * 10**9, 0, 1.0, 0.0)],
    )


def test_json_has_the_design_shape_and_round_trips(tmp_path) -> None:
    result = _result()
    obj = json.loads(json.dumps(result.to_json()))
    assert obj["makespan_s"] == 2.5
    assert obj["tasks"]["b"] == {"start_s": 1.0, "end_s": 2.5}
    assert obj["gpus"]["gpu0"] == {
        "busy_s": 1.0,
        "stall_s": 0.5,
        "peak_bytes": 10**9,
        "idle_s": 1.0,
    }
    assert obj["links"][0] == {
        "a": "gpu0",
        "b": "cpu0",
        "bytes_ab": 12 * 10**9,
        "bytes_ba": 0,
        "busy_s_ab": 1.0,
        "busy_s_ba": 0.0,
    }
    assert SimResult.from_json(obj) == result
    result.save(tmp_path / "r.json")
    assert SimResult.load(tmp_path / "r.json") == result
    assert result.tasks["b"].duration_s == 1.5


def test_wrong_format_is_refused() -> None:
    with pytest.raises(PipeswapError, match="pipeswap.simresult/1"):
        SimResult.from_json({**_result().to_json(), "format": "pipeswap.graph/1"})
