"""Tests of pipeswap.progress."""

import io
import sys

import pytest

from pipeswap.progress import progress_bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_when_disabled_or_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress_bar(10, "train") is None
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert progress_bar(10, "train", enabled=False) is None


def test_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _Tty())
    bar = progress_bar(3, "train")
    assert bar is not None and bar.total == 3
    bar.close()
