"""Progress bars for training loops: shown on a terminal, silent in logs and CI."""

from __future__ import annotations

import sys
import threading
from typing import Any


def progress_bar(total: int, desc: str, *, enabled: bool = True) -> Any | None:
    """A tqdm bar on stderr, or None when disabled or stderr is not a terminal.

    Callers pass ``enabled=False`` on every rank but 0. In a log file a bar's carriage
    returns only add noise, so redirected output gets the final summary lines alone.
    """
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    # tqdm's default lock is a process-shared semaphore, which a rank ending in os._exit
    # would leak (and the resource tracker would warn about); one process needs only a
    # thread lock.
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc=desc, unit="step", leave=False)
