"""pipeswap/json_fields.py: each field checked, the refusal naming where and what to write."""

from __future__ import annotations

import pytest

from pipeswap import json_fields as fields
from pipeswap.errors import PipeswapError


def test_counts_are_whole_and_at_least_the_minimum() -> None:
    assert fields.count_field({"n": 1e9}, "n", "here") == 10**9  # 1e9 written as a float
    for bad in (1.5, True, -1, "3"):
        with pytest.raises(PipeswapError, match="here: n is .*; write a whole number >= 0"):
            fields.count_field({"n": bad}, "n", "here")
    assert fields.count_field({}, "n", "here", default=7) == 7
    with pytest.raises(PipeswapError, match="here: n is missing; add it"):
        fields.count_field({}, "n", "here")


def test_seconds_texts_lists_and_objects() -> None:
    assert fields.seconds_field({"t": 2}, "t", "w") == 2.0
    with pytest.raises(PipeswapError, match="finite number of seconds"):
        fields.seconds_field({"t": float("nan")}, "t", "w")
    with pytest.raises(PipeswapError, match="write a string"):
        fields.text_field({"s": 3}, "s", "w")
    with pytest.raises(PipeswapError, match="write a JSON list"):
        fields.list_field({"l": {}}, "l", "w")
    with pytest.raises(PipeswapError, match="expected a JSON object, found \\[1\\]"):
        fields.as_object([1], "w")
    assert fields.shown("x" * 60).endswith("...")
