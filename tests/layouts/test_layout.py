"""The Layout contract: versioned JSON that reads back equal, and a refusal of other formats."""

from __future__ import annotations

import json

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.layouts.layout import LAYOUT_FORMAT, PIPELINE_DP, Layout, StageLayout

LAYOUT = Layout(
    family=PIPELINE_DP,
    model="toy",
    topology="switch-4",
    budget_bytes=10**9,
    batch=2,
    stages=2,
    replicas=2,
    samples_per_step=8,
    samples_per_update=8,
    samples_per_s=12.5,
    peak_bytes=9 * 10**8,
    graph_s=3.25,
    steps=4,
    schedule="1f1b",
    weights="stale",
    micro_batches=4,
    balance=(3, 5),
    placement=(("gpu0", "gpu1"), ("gpu2", "gpu3")),
    mapping="cross",
    coordinated=True,
    stage_plans=(
        StageLayout(0, ("l0", "l1", "l2"), ("l0",), ("l2",), 2, 8 * 10**8),
        StageLayout(1, ("l3", "l4", "l5", "l6", "l7"), peak_bytes=9 * 10**8),
    ),
)


def test_a_layout_reads_back_equal(tmp_path) -> None:
    path = tmp_path / "layout.json"
    LAYOUT.save(path)
    obj = json.loads(path.read_text())
    assert obj["format"] == LAYOUT_FORMAT == "pipeswap.layout/1"
    assert Layout.load(path) == LAYOUT
    assert LAYOUT.gpus == 4
    assert LAYOUT.name == "pp2x2 1f1b m4 (cross, coordinated)"


def test_other_formats_and_missing_fields_are_refused(tmp_path) -> None:
    obj = LAYOUT.to_json()
    with pytest.raises(PipeswapError, match="pipeswap.layout/1"):
        Layout.from_json({**obj, "format": "pipeswap.layout/0"})
    del obj["model"]
    with pytest.raises(PipeswapError, match="malformed layout"):
        Layout.from_json(obj)
