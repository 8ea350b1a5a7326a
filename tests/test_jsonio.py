"""Tests of pipeswap/jsonio.py: atomic writes and versioned JSON."""

import json
import os
from pathlib import Path

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import dump_json, load_json, write_atomic


def test_write_atomic_replaces_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "report.json"
    write_atomic(target, "first")
    write_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    assert sorted(os.listdir(target.parent)) == ["report.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    dump_json(target, {"format": "x/1", "value": 1})
    with pytest.raises(TypeError):
        dump_json(target, {"format": "x/1", "value": object()})  # not serializable
    assert json.loads(target.read_text()) == {"format": "x/1", "value": 1}
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_load_json_checks_format_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    dump_json(path, {"format": "pipeswap.graph/1"})
    assert load_json(path, "pipeswap.graph/1") == {"format": "pipeswap.graph/1"}
    with pytest.raises(PipeswapError, match=r"expected format 'pipeswap.profile/1'"):
        load_json(path, "pipeswap.profile/1")
    with pytest.raises(PipeswapError, match="no such file"):
        load_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PipeswapError, match="not valid JSON"):
        load_json(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(PipeswapError, match="expected a JSON object"):
        load_json(tmp_path / "list.json")
