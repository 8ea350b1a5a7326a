"""Chrome traces: one complete event per compute action, times in microseconds.

Covers: pipeswap/pipeline/chrome.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeswap.pipeline.chrome import chrome_trace, dump_chrome_trace, timeline_events
from pipeswap.schedule.timetable import build_schedule, unit_time_order


def test_trace_has_one_complete_event_per_pass(tmp_path: Path) -> None:
    schedule = build_schedule("1f1b", 3, 2, 3)
    timeline = unit_time_order(schedule, backward_cost=2)
    trace = chrome_trace(timeline, seconds_per_unit=1e-3)
    assert trace["traceEvents"] == timeline_events(timeline, seconds_per_unit=1e-3)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(schedule.compute_actions(k)) for k in range(3))
    b0 = next(e for e in complete if e["name"] == "2B0")
    assert b0["tid"] == 2 and b0["ts"] == 3000.0 and b0["dur"] == 2000.0
    path = tmp_path / "t.json"
    dump_chrome_trace(path, timeline)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))
