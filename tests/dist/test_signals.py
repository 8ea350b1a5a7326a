"""pipeswap/dist/signals.py: within sigterm_interrupts SIGTERM interrupts as Ctrl-C does."""

from __future__ import annotations

import os
import signal

import pytest

from pipeswap.dist.signals import LauncherInterrupted, sigterm_interrupts


def test_sigterm_interrupts_inside_and_the_previous_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(LauncherInterrupted) as stopped, sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.5)  # the handler runs at the next bytecode
    assert isinstance(stopped.value, KeyboardInterrupt)  # a script's Ctrl-C handling sees it
    assert stopped.value.signum == signal.SIGTERM and str(stopped.value) == "stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before


def test_what_a_stopped_launcher_carries() -> None:
    stopped = LauncherInterrupted(signal.SIGINT, "rank 0 wrote its checkpoint", value=7)
    assert (stopped.message, stopped.value, str(stopped)) == (
        "rank 0 wrote its checkpoint",
        7,
        "rank 0 wrote its checkpoint",
    )
