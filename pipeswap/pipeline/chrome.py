"""Chrome-trace (Perfetto) JSON of a schedule's timeline: one track per stage."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import TimedAction
from pipeswap.sim.trace import metadata_event, trace_document, write_chrome_trace

__all__ = ["chrome_trace", "dump_chrome_trace", "timeline_events"]

_NAMES = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.UPDATE: "update"}


def chrome_trace(
    timeline: Sequence[TimedAction], *, title: str = "pipeline", seconds_per_unit: float = 1e-3
) -> dict[str, Any]:
    """Trace events for the compute actions of ``timeline`` (times scaled to microseconds).

    ``seconds_per_unit`` converts the timeline's time unit: 1e-3 shows an idealized
    schedule's ticks as milliseconds; measured timelines (in seconds) pass 1.0.
    Transfers appear as instant events on the sending and receiving tracks.
    """
    return trace_document(timeline_events(timeline, title=title, seconds_per_unit=seconds_per_unit))


def dump_chrome_trace(
    path: str | os.PathLike[str], timeline: Sequence[TimedAction], **kwargs: Any
) -> None:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    write_chrome_trace(path, timeline_events(timeline, **kwargs))


def timeline_events(
    timeline: Sequence[TimedAction], *, title: str = "pipeline", seconds_per_unit: float = 1e-3
) -> list[dict[str, Any]]:
    """The events of :func:`chrome_trace`: a thread per stage, "X" per pass, "i" per transfer."""
    scale = seconds_per_unit * 1e6
    events = [metadata_event("process_name", 0, 0, {"name": title})]
    for stage in sorted({t.stage for t in timeline}):
        events.append(metadata_event("thread_name", 0, stage, {"name": f"stage {stage}"}))
    for timed in timeline:
        act = timed.action
        base = {"pid": 0, "tid": timed.stage, "ts": timed.start * scale, "cat": act.kind}
        if act.kind in _NAMES:
            events.append(
                base
                | {
                    "ph": "X",
                    "name": str(act),
                    "dur": (timed.end - timed.start) * scale,
                    "args": {"pass": _NAMES[act.kind], "unit": act.unit},
                }
            )
        else:
            events.append(base | {"ph": "i", "s": "t", "name": str(act)})
    return events
