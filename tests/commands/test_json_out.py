"""pipeswap/commands/json_out.py: a --json result alone on stdout, whatever else printed."""

from __future__ import annotations

import json

import pytest

from pipeswap.commands.json_out import json_stdout, print_json


def test_only_the_result_reaches_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with json_stdout(True):
        print("a user's builder says hello")
        print_json({"ok": 1})
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"ok": 1}
    assert "hello" in captured.err
    with json_stdout(False):
        print("plain")
    assert capsys.readouterr().out == "plain\n"
