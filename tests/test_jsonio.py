"""Tests of pipeswap/jsonio.py: atomic writes and versioned JSON."""

import json
import os
from pathlib import Path

import pytest

from pipeswap import jsonio
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


def test_load_json_refuses_non_utf8_text(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes('{"name": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(PipeswapError, match=r"latin1.json is not UTF-8 text \(byte 0xe9 at offset"):
        load_json(path)
    # A UTF-8 byte-order mark, as some editors write, is fine.
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + '{"name": "caf\u00e9"}'.encode())
    assert load_json(tmp_path / "bom.json") == {"name": "caf\u00e9"}


def test_load_json_refuses_a_file_over_the_size_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jsonio, "MAX_JSON_BYTES", 10)
    path = tmp_path / "big.json"
    path.write_text('{"a": 12345}')  # 12 bytes
    with pytest.raises(PipeswapError, match=r"big.json is 12 bytes; .* at most 10 bytes"):
        load_json(path)
    path.write_text('{"a": 1}')
    assert load_json(path) == {"a": 1}


def test_load_json_refuses_a_directory_and_a_path_through_a_file(tmp_path: Path) -> None:
    with pytest.raises(PipeswapError, match="is a directory; give a JSON file"):
        load_json(tmp_path)
    (tmp_path / "f").write_text("{}")
    with pytest.raises(PipeswapError, match="no such file"):
        load_json(tmp_path / "f" / "x.json")


def test_load_json_refuses_an_unreadable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret.json"
    path.write_text("{}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # root reads anything: simulate it

        def denied(*args: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(jsonio, "open", denied, raising=False)
    else:
        path.chmod(0)
    with pytest.raises(PipeswapError, match=r"cannot read .*secret.json: permission denied"):
        load_json(path)


def test_load_json_refuses_deep_nesting(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(PipeswapError, match="deep.json nests deeper than pipeswap reads"):
        load_json(path)


@pytest.mark.parametrize("number", ["1e400", "-1e400", "Infinity", "-Infinity", "NaN"])
def test_load_json_refuses_non_finite_numbers(tmp_path: Path, number: str) -> None:
    path = tmp_path / "n.json"
    path.write_text(f'{{"duration_s": [1.5, {number}]}}')
    with pytest.raises(PipeswapError, match=rf"n.json contains a non-finite number \({number}\)"):
        load_json(path)


def test_load_json_keeps_ordinary_numbers(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    path.write_text('{"a": 1e300, "b": -0.0, "c": 12345678901234567890, "d": 5e-324}')
    assert load_json(path) == {"a": 1e300, "b": -0.0, "c": 12345678901234567890, "d": 5e-324}


def test_load_json_limits_a_stream_whose_size_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonio, "MAX_JSON_BYTES", 10)
    read_end, write_end = os.pipe()  # size 0, like /dev/stdin or a process substitution
    with os.fdopen(write_end, "wb") as writer:
        writer.write(b'{"a": 1234567890}')
    try:
        with pytest.raises(PipeswapError, match=r"is larger than that; .* at most 10 bytes"):
            load_json(f"/dev/fd/{read_end}")
    finally:
        os.close(read_end)
