"""Signals that end a run: SIGTERM interrupts as Ctrl-C does, and what a stopped launcher says."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["LauncherInterrupted", "sigterm_interrupts"]


class LauncherInterrupted(KeyboardInterrupt):
    """The launcher got SIGTERM (or SIGINT) while ranks ran; they were stopped first (by
    SIGTERM). ``message``: what the ranks said as they stopped (where, their checkpoint);
    ``value``: rank 0's return value, when every rank ended well."""

    def __init__(self, signum: int, message: str | None = None, value: Any = None) -> None:
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.message = message
        self.value = value


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within it SIGTERM interrupts, as SIGINT does (:class:`LauncherInterrupted`): a
    launcher stops its ranks, a command ends with one line (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise LauncherInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
