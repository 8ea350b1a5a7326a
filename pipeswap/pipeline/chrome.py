"""Chrome-trace (Perfetto) JSON of a schedule's timeline: one track per stage."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from pipeswap.jsonio import write_atomic
from pipeswap.pipeline.validate import TimedAction

_NAMES = {"F": "forward", "B": "backward", "UPDATE": "update"}


def chrome_trace(
    timeline: Sequence[TimedAction], *, title: str = "pipeline", seconds_per_unit: float = 1e-3
) -> dict[str, Any]:
    """Trace events for the compute actions of ``timeline`` (times scaled to microseconds).

    ``seconds_per_unit`` converts the timeline's time unit: 1e-3 shows an idealized
    schedule's slots as milliseconds; measured timelines (in seconds) pass 1.0.
    Transfers appear as instant events on the sending and receiving tracks.
    """
    scale = seconds_per_unit * 1e6
    ranks = sorted({t.rank for t in timeline})
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": title}}
    ]
    for rank in ranks:
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"stage {rank}"},
            }
        )
    for timed in timeline:
        act = timed.action
        base = {"pid": 0, "tid": timed.rank, "ts": timed.start * scale, "cat": act.kind}
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
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def dump_chrome_trace(
    path: str | os.PathLike[str], timeline: Sequence[TimedAction], **kwargs: Any
) -> None:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    write_atomic(path, json.dumps(chrome_trace(timeline, **kwargs)) + "\n")
