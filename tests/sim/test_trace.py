"""The Chrome trace export: the one trace writer, and a simulated run's events.

Covers: pipeswap/sim/trace.py.
"""

import json

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.engine import simulate
from pipeswap.sim.trace import (
    chrome_trace,
    metadata_event,
    trace_document,
    write_chrome_trace,
    write_trace,
)

GB = 10**9


def _run(record_rates: bool = True):
    topology = preset("switch-4", gpu_memory_bytes=0, copy_engines=1)
    b = GraphBuilder()
    f = b.compute("gpu0", 0.5, alloc_bytes=GB, id="f")
    out = b.d2h("gpu0", 6 * GB, deps=[f], free_bytes=GB, id="out")
    b.h2d("gpu1", 6 * GB, id="in")
    b.p2p("gpu0", "gpu2", GB, deps=[out], id="send")
    b.allreduce(topology.gpus, 4 * GB, deps=["send"], id="ar")
    b.barrier(["gpu0", "gpu1"], deps=["ar"], id="bar")
    graph = b.build()
    return graph, simulate(graph, topology, record_rates=record_rates), topology


def test_trace_events_follow_the_chrome_format(tmp_path) -> None:
    graph, result, topology = _run()
    path = tmp_path / "trace.json"
    write_trace(path, graph, result, topology)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert isinstance(event["name"], str) and event["name"]
        assert event["ph"] in ("X", "M", "C")
        assert isinstance(event["pid"], int)
        if event["ph"] == "X":
            assert isinstance(event["tid"], int)
            assert isinstance(event["ts"], float) and event["ts"] >= 0
            assert isinstance(event["dur"], float) and event["dur"] >= 0
        elif event["ph"] == "C":
            assert event["ts"] >= 0
            assert all(isinstance(v, float) and v >= 0 for v in event["args"].values())
        else:
            assert event["name"] in (
                "process_name",
                "thread_name",
                "process_sort_index",
                "thread_sort_index",
            )
            assert "args" in event
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == sorted(topology.gpus + ["links"])
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    # Every X event sits on a named thread of a named process.
    for event in events:
        if event["ph"] == "X":
            assert (event["pid"], event["tid"]) in threads
    # copy_engines=1: one shared copy thread per GPU.
    assert set(threads.values()) == {"compute", "copy", "comm"}


def test_task_events_match_the_simulated_times() -> None:
    graph, result, topology = _run()
    events = chrome_trace(graph, result, topology)["traceEvents"]
    by_name: dict[str, list[dict]] = {}
    for event in events:
        if event["ph"] == "X":
            by_name.setdefault(event["name"], []).append(event)
    assert len(by_name["ar"]) == 4 and len(by_name["send"]) == 2 and len(by_name["bar"]) == 2
    for task_id, timing in result.tasks.items():
        for event in by_name[task_id]:
            assert event["ts"] == pytest.approx(timing.start_s * 1e6)
            assert event["dur"] == pytest.approx((timing.end_s - timing.start_s) * 1e6)
    assert by_name["out"][0]["args"] == {"bytes": 6 * GB, "free_bytes": GB, "deps": ["f"]}


def test_link_counters_carry_throughput_in_gb_per_s() -> None:
    graph, result, topology = _run()
    counters = [e for e in chrome_trace(graph, result, topology)["traceEvents"] if e["ph"] == "C"]
    uplink = [e for e in counters if e["name"] == "sw0->cpu0"]
    busy = [e for e in uplink if e["args"]["GB/s"] > 0]
    # The d2h starts at 0.5 s, the only transfer up sw0->cpu0: the full 12 GB/s.
    assert busy[0]["ts"] == pytest.approx(0.5e6) and busy[0]["args"]["GB/s"] == 12.0
    assert uplink[-1]["args"]["GB/s"] == 0.0
    _, bare, _ = _run(record_rates=False)
    assert not [e for e in chrome_trace(graph, bare, topology)["traceEvents"] if e["ph"] == "C"]


def test_the_writer_round_trips_events_and_metadata(tmp_path) -> None:
    events = [
        metadata_event("process_name", 0, None, {"name": "p"}),
        {"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0.0, "dur": 5.0},
    ]
    assert "tid" not in events[0] and metadata_event("thread_name", 0, 1, {})["tid"] == 1
    path = tmp_path / "sub" / "trace.json"
    write_chrome_trace(path, events, {"run": 3})
    assert json.loads(path.read_text()) == {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run": 3},
    }
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    assert "otherData" not in trace_document(events)


def test_write_trace_writes_chrome_trace(tmp_path) -> None:
    graph, result, topology = _run()
    path = tmp_path / "trace.json"
    write_trace(path, graph, result, topology)
    assert json.loads(path.read_text()) == json.loads(
        json.dumps(chrome_trace(graph, result, topology))
    )
