"""Progress bars for training loops: shown on a terminal, silent in logs and CI."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

__all__ = ["bars_shown", "progress_bar", "thread_lock_for_bars"]


def bars_shown() -> bool:
    """Our rule for every progress bar, a library's too: rank 0 (the RANK variable that
    torchrun and our launcher set) and a terminal only."""
    return os.environ.get("RANK", "0") in ("", "0") and sys.stderr.isatty()


def thread_lock_for_bars() -> None:
    """Give tqdm a thread lock: its default is a process-shared semaphore, which a rank
    ending in os._exit would leak (and the resource tracker would warn about); one
    process needs only a thread lock."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def progress_bar(total: int, desc: str, *, enabled: bool = True) -> Any | None:
    """A tqdm bar on stderr, or None when disabled or stderr is not a terminal.

    Callers pass ``enabled=False`` on every rank but 0. In a log file a bar's carriage
    returns only add noise, so redirected output gets the final summary lines alone.
    """
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    thread_lock_for_bars()
    return tqdm(total=total, desc=desc, unit="step", leave=False)
