"""Crashes are one line unless PIPESWAP_DEBUG asks for the traceback."""

from __future__ import annotations

import pytest

from pipeswap import errors
from pipeswap.cli import main
from pipeswap.commands import env


def test_crash_line_keeps_the_type_and_first_line() -> None:
    line = errors.crash_line(RuntimeError("boom\nsecond"))
    assert line == "RuntimeError: boom (set PIPESWAP_DEBUG=1 for the traceback)"
    assert errors.crash_line(KeyError()) == "KeyError:  (set PIPESWAP_DEBUG=1 for the traceback)"


@pytest.mark.parametrize("value,expected", [("", False), ("0", False), ("1", True), ("yes", True)])
def test_debugging_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv("PIPESWAP_DEBUG", value)
    assert errors.debugging() is expected


def test_a_crashing_command_exits_1_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def crash(args: object) -> int:
        raise RuntimeError("boom\nsecond")

    monkeypatch.setattr(env, "run", crash)
    monkeypatch.delenv("PIPESWAP_DEBUG", raising=False)
    assert main(["env"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "pipeswap env: crashed: RuntimeError: boom (set PIPESWAP_DEBUG=1 for the traceback)\n"
    )
    monkeypatch.setenv("PIPESWAP_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["env"])


def test_a_rank_under_torchrun_that_lost_its_peers_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the surviving node of a 2-node torchrun run printed gloo's traceback.
    def lose_peers(args: object) -> int:
        raise RuntimeError(
            "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4711"
        )

    monkeypatch.setattr(env, "run", lose_peers)
    monkeypatch.delenv("PIPESWAP_DEBUG", raising=False)
    assert main(["env"]) == 1
    assert capsys.readouterr().err == (
        "pipeswap env: stopped: this rank lost its peers: another rank ended first\n"
    )
